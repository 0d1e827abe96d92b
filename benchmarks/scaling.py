"""How the cost of a training step grows: tokens/s and peak memory against sequence length and model size, ours vs
torchtune 0.6.1 vs transformers + peft, with packing on and off.

    python benchmarks/scaling.py                      # the README's scaling table (~15 min on 2 cores)
    python benchmarks/scaling.py --mode full --impls ours hf

Every row is one `train_step.py` process per library at 4,096 tokens per step (batch x sequence length), so a row
compares the same work and the sequence-length sweep isolates attention's growth:

- **sequence sweep** on the ~32M-parameter shape: 256, 1k, 2k and 4k positions, packing off (one document per row,
  causal) and on (a row of `max(2, seq / 256)` documents of random lengths, a block-causal mask);
- **size sweep** at 1,024 positions: the tiny shape (4.2M), ~32M and ~101M parameters.

Each measurement is a fresh process, the libraries one after another (ours, torchtune, transformers). Results are
appended to benchmarks/scaling.jsonl and printed as a markdown table.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = {"ours": sys.executable, "hf": sys.executable, "torchtune": str(HERE / ".venv-torchtune" / "bin" / "python")}
TOKENS_PER_STEP = 4096
SHAPES = {  # vocab, layers, dim, heads, kv heads, ffn
    "tiny 4.2M": dict(vocab=2048, layers=4, dim=256, heads=8, kv_heads=4, ffn=768),
    "32M": dict(vocab=8192, layers=8, dim=512, heads=8, kv_heads=4, ffn=1408),
    "101M": dict(vocab=16384, layers=12, dim=768, heads=12, kv_heads=4, ffn=2048),
}


def measure(impl: str, shape: str, seq: int, docs: int, args) -> dict:
    "One process of train_step.py; its JSON line."
    sizes = {**SHAPES[shape], "seq": seq, "batch": TOKENS_PER_STEP // seq, "docs": docs,
             "warmup": args.warmup, "steps": args.steps}
    command = [PYTHON[impl], str(HERE / "train_step.py"), "--impl", impl, "--mode", args.mode, "--dtype", args.dtype]
    command += [item for key, value in sizes.items() for item in (f"--{key}", str(value))]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{impl} {shape} seq={seq} docs={docs} failed:\n{result.stderr[-2000:]}")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "shape": shape}


def rows(args) -> list[tuple[str, int, int]]:
    "(shape, sequence length, documents per row): the sequence sweep, then the size sweep."
    sweep = [("32M", seq, docs) for seq in args.seqs for docs in (1, max(2, seq // 256))]
    return sweep + [(shape, 1024, 1) for shape in SHAPES if shape != "32M"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["full", "lora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--impls", nargs="+", default=["ours", "torchtune", "hf"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[256, 1024, 2048, 4096])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if "torchtune" in args.impls and not Path(PYTHON["torchtune"]).exists():
        raise SystemExit("the torchtune peer environment is missing: bash benchmarks/make_peer_env.sh")
    names = {"ours": "ours", "torchtune": "torchtune", "hf": "transformers+peft"}
    peers = [i for i in args.impls if i != "ours"] if "ours" in args.impls else []
    columns = [f"{names[i]} tok/s (MiB)" for i in args.impls] + [f"ours/{names[i]}" for i in peers]
    table = ["| shape | seq x batch | packing | " + " | ".join(columns) + " |", "|---" * (3 + len(columns)) + "|"]
    for shape, seq, docs in rows(args):
        results = {impl: measure(impl, shape, seq, docs, args) for impl in args.impls}
        with open(HERE / "scaling.jsonl", "a") as log:
            log.write(json.dumps({"mode": args.mode, "dtype": args.dtype, "results": results}) + "\n")
        cells = [f"{r['tokens_per_second']:,.0f} ({r['peak_rss_mib']:,.0f})" for r in results.values()]
        ratio_cells = [f"{results['ours']['tokens_per_second'] / results[i]['tokens_per_second']:.2f}" for i in peers]
        packing = f"{docs} docs" if docs > 1 else "off"
        table.append(f"| {shape} | {seq} x {TOKENS_PER_STEP // seq} | {packing} | " + " | ".join(cells + ratio_cells) + " |")
        print(table[-1], flush=True)
    print(f"\n{args.mode}, {args.dtype}, {TOKENS_PER_STEP} tokens per step\n" + "\n".join(table))


if __name__ == "__main__":
    main()
