"""The runs the worked example (nbs/95_worked_example.ipynb) quotes but does not train itself, to keep it short: the
two halves of the fix alone (the first attempt's data with the main job's schedule; the new data with the first
attempt's alpha and learning rate) and the main job with seeds 1 and 2. Each is a `tunelit run
lora_finetune_single_device` of tiny/lora with overrides, then `eval_accuracy` (tiny/eval) on its `best/`.

    python benchmarks/worked_example_variants.py [--work /tmp/worked_example_variants]

Writes torchtune_lit/assets/results/worked_example_variants.json (the chapter reads it). About 5 minutes on 2 cores.
"""
import argparse
import json
import platform
from pathlib import Path

import torch

import torchtune_lit.recipes.eval_accuracy as eval_recipe
import torchtune_lit.recipes.lora_finetune_single_device as lora_recipe
from torchtune_lit import config
from torchtune_lit.datasets._tiny_world import make_column_examples

OUT = Path(__file__).resolve().parents[1] / "torchtune_lit" / "assets" / "results" / "worked_example_variants.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/worked_example_variants"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    first_data = args.work / "first_train.jsonl"  # the first attempt's data, as the chapter writes it
    first_rows = make_column_examples("train", per_label=40, seed=0)
    first_data.write_text("".join(json.dumps(r) + "\n" for r in first_rows))
    runs = {
        "first_data_main_schedule": [f"dataset.data_files={first_data}", "epochs=8"],
        "new_data_first_alpha_lr": ["model.lora_alpha=16", "optimizer.lr=6e-3"],
        "main_seed_1": ["seed=1"],
        "main_seed_2": ["seed=2"],
    }
    results = {}
    for name, overrides in runs.items():
        out = args.work / name
        common = [f"output_dir={out}", "progress_bar=false", "preflight=false"]
        history = lora_recipe.train(config.load_config("tiny/lora", common + overrides))
        evaluated = eval_recipe.evaluate(config.load_config("tiny/eval", [
            f"output_dir={out / 'eval_best'}", f"checkpointer.checkpoint_dir={out / 'best'}"]))
        shown = [o.replace(str(args.work), "WORK") for o in overrides]  # no machine's scratch path in the record
        results[name] = {"overrides": shown, "steps": len(history), "accuracy": evaluated["accuracy"]}
        print(f"{name}: {len(history)} steps, held-out accuracy {evaluated['accuracy']:.1%}", flush=True)
    record = {
        "command": "python benchmarks/worked_example_variants.py",
        "recipe": "tunelit run lora_finetune_single_device --config tiny/lora [overrides], then eval_accuracy",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "runs": results,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
