"""QAT against post-training quantization (PTQ) on the tiny world, at the full recipe budget (2 epochs).

For each seed: fine-tune the tiny base with `full_finetune_single_device` (tiny/full), with `qat_single_device` at
8da4w (tiny/qat) and with `qat_single_device` at int8-activation / int2-weight; then measure every `best/` model in
float and converted to int4 and int2 weights (groups of 32): held-out answer perplexity and greedy accuracy on the 96
evaluation prompts. PTQ is the plain fine-tune converted; QAT is the QAT fine-tune converted at its own width.

    python benchmarks/qat_vs_ptq.py --seeds 0 1 2 [--work /tmp/qat_vs_ptq]

Prints one table per seed and writes `results.json` into the work folder. About 4 minutes per seed on 2 cores.
"""
import argparse
import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

import torchtune_lit.config as config
import torchtune_lit.data as data
import torchtune_lit.datasets._builders as builders
import torchtune_lit.generation as generation
import torchtune_lit.training as training
from torchtune_lit.recipes.quantize import perplexity
from torchtune_lit.training.quantization import Int8DynActIntxWeightQATQuantizer

logging.getLogger("torchao").setLevel(logging.ERROR)
TUNELIT = str(Path(sys.executable).parent / "tunelit")
QAT = "quantizer._component_=torchtune_lit.training.quantization.Int8DynActIntxWeightQATQuantizer"
RUNS = {
    "plain": ("full_finetune_single_device", "tiny/full", []),
    "qat_int4": ("qat_single_device", "tiny/qat", [QAT, "quantizer.weight_bits=4"]),
    "qat_int2": ("qat_single_device", "tiny/qat", [QAT, "quantizer.weight_bits=2"]),
}


def held_out():
    "The evaluation prompts (for accuracy) and a loader of prompt + answer (for answer perplexity)."
    cfg, eval_cfg = config.load_config("tiny/full"), config.load_config("tiny/eval")
    tokenizer = config.instantiate(cfg.tokenizer)
    rows = builders.load_rows("json", "train", data_files=eval_cfg.dataset.data_files)
    system = data.Message("system", eval_cfg.system_prompt, masked=True)
    prompts = [tokenizer.tokenize_messages([system, data.Message("user", r["prompt"], masked=True)],
                                           add_generation_prompt=True)[0] for r in rows]
    dataset_cfg = {**OmegaConf.to_container(cfg.validation_dataset, resolve=True),
                   "data_files": eval_cfg.dataset.data_files}
    dataset = config.instantiate(OmegaConf.create(dataset_cfg), tokenizer)
    loader = DataLoader(dataset, batch_size=16, shuffle=False, collate_fn=data.padded_collate_sft)
    return tokenizer, rows, prompts, loader


def accuracy(model, tokenizer, rows, prompts) -> float:
    stops = [tokenizer.eot_id, tokenizer.eos_id]
    answers = []
    for start in range(0, len(prompts), 32):
        for tokens in generation.generate(model, prompts[start:start + 32], 12, stop_tokens=stops):
            answers.append(tokenizer.decode([t for t in tokens if t not in stops]).strip())
    return sum(a == r["label"] for a, r in zip(answers, rows)) / len(rows)


def measure(folder: Path, tokenizer, rows, prompts, loader) -> dict:
    model = training.load_model_for_eval(training.FullModelHFCheckpointer(folder), torch.device("cpu"),
                                         torch.float32)
    result = {}
    for name, bits in (("float", None), ("int4", 4), ("int2", 2)):
        quantized = copy.deepcopy(model)
        if bits:
            Int8DynActIntxWeightQATQuantizer(bits, 32).convert(quantized)
        with torch.no_grad():
            result[name] = {"perplexity": perplexity(quantized, loader, torch.device("cpu")),
                            "accuracy": accuracy(quantized, tokenizer, rows, prompts)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qat_vs_ptq"))
    args = parser.parse_args()
    evaluation = held_out()
    results = {}
    for seed in args.seeds:
        for run, (recipe, config_name, extra) in RUNS.items():
            out = args.work / f"seed{seed}" / run
            if not (out / "best").exists():
                subprocess.run([TUNELIT, "run", recipe, "--config", config_name, f"output_dir={out}", f"seed={seed}",
                                "progress_bar=false", *extra], check=True, capture_output=True)
            results.setdefault(str(seed), {})[run] = measure(out / "best", *evaluation)
        print(f"seed {seed}: accuracy / answer perplexity on 96 held-out prompts")
        print(f"{'fine-tune':<10}{'float':>16}{'int4':>16}{'int2':>16}")
        for run, by_width in results[str(seed)].items():
            cells = "".join(f"{v['accuracy']:>8.1%} {v['perplexity']:.4f}" for v in by_width.values())
            print(f"{run:<10}{cells}")
        (args.work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
