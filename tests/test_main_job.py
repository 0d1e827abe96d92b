"""The README's main job, end to end: LoRA-fine-tune the shipped tiny base on the column-type task and measure the
held-out accuracy before and after, through the installed `tunelit` command (about a minute and a half on two
cores). The threshold is the issue's: >= 90 % exact match on the evaluation split, whose headers training never saw
(seeds 0-2 measured 91.7-94.8 %; one seed runs here)."""
import json
import subprocess
import sys
from pathlib import Path

import peft
import torch
import transformers

TUNELIT = str(Path(sys.executable).parent / "tunelit")


def tunelit(*args: str) -> str:
    result = subprocess.run([TUNELIT, *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_lora_main_job_reaches_90_percent_and_every_epoch_is_usable(tmp_path):
    run = tmp_path / "lora"
    tunelit("run", "eval_accuracy", "--config", "tiny/eval", f"output_dir={tmp_path / 'before'}")
    summary = tunelit("run", "lora_finetune_single_device", "--config", "tiny/lora", f"output_dir={run}",
                      "progress_bar=false")
    tunelit("run", "eval_accuracy", "--config", "tiny/eval", f"checkpointer.checkpoint_dir={run / 'best'}",
            f"output_dir={run / 'eval_best'}")
    before = json.loads((tmp_path / "before" / "eval.json").read_text())["accuracy"]
    after = json.loads((run / "eval_best" / "eval.json").read_text())["accuracy"]
    print(f"held-out accuracy: base {before:.1%}, after LoRA {after:.1%}")
    assert before <= 0.05 and after >= 0.90, (before, after)

    # the summary says where the best epoch is and how to evaluate it
    info = json.loads((run / "run.json").read_text())
    assert f"best epoch: {info['best_epoch']}, in {run / 'best'}" in summary
    assert f"checkpointer.checkpoint_dir={run / 'best'}" in summary
    # one run, one log: 450 steps, each with this run's id
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 451)) and {r["run_id"] for r in log} == {info["run_id"]}
    assert log[-1]["loss"] < 0.1 * log[0]["loss"]

    # every epoch is saved and loads in transformers with its tokenizer; the adapter equals the merged model
    from torchtune_lit.config import _asset_path

    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    for epoch in range(3):
        folder = run / f"epoch_{epoch}"
        merged = transformers.AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        assert tokenizer.convert_ids_to_tokens(6) == "<|eot_id|>"
        base = transformers.AutoModelForCausalLM.from_pretrained(_asset_path("tiny/base"))
        with_adapter = peft.PeftModel.from_pretrained(base, folder / "adapter")
        with torch.no_grad():
            torch.testing.assert_close(with_adapter(tokens).logits, merged(tokens).logits, atol=1e-4, rtol=1e-4)

    # the best folder answers through a transformers pipeline, chat template included
    question = json.loads(Path(_asset_path("tiny/column_types_eval.jsonl")).read_text().splitlines()[0])
    pipe = transformers.pipeline("text-generation", model=str(run / "best"))
    chat = [{"role": "system", "content": "You name the semantic type of a table column. Answer with one label."},
            {"role": "user", "content": question["prompt"]}]
    answer = pipe(chat, max_new_tokens=12, do_sample=False)[0]["generated_text"][-1]["content"]
    assert answer.strip() == question["label"], (answer, question["label"])

    # the run in a picture and in a table
    assert "loss.png" in tunelit("plot", str(run)) and (run / "loss.png").stat().st_size > 10_000
    table = tunelit("runs", str(run)).splitlines()
    assert table[0].split()[:2] == ["run", "steps"] and table[1].split()[-1] == f"{after:.1%}"
