"""Run ours and a peer alternately (A B A B ...) in one session and print the ratio per pair and its median.

    python benchmarks/compare.py --peer hf --mode lora --dtype bf16 --pairs 3          # vs transformers + peft
    python benchmarks/compare.py --peer torchtune --mode qlora --dtype bf16 --pairs 3  # vs torchtune 0.6.1
    python benchmarks/compare.py --peer torchtune --mode lora --compile                # both sides compiled

Each measurement is a fresh process (train_step.py), so neither side inherits the other's caches; alternating
spreads the noise of a shared machine over both sides. The torchtune peer runs in its own environment
(benchmarks/.venv-torchtune, made by make_peer_env.sh: torchtune 0.6.1 needs torchao 0.15). Also prints the machine's
matmul throughput (2048^3) and the fraction of it our step achieves (model FLOPs per step ~ 6 x parameters x tokens
for full fine-tuning, ~ 4x for frozen-base LoRA, divided by the step time). Each pair's JSON is appended to
benchmarks/results.jsonl.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PYTHON = {"ours": sys.executable, "hf": sys.executable, "torchtune": str(HERE / ".venv-torchtune" / "bin" / "python")}
NAMES = {"hf": "transformers+peft", "torchtune": "torchtune 0.6.1"}


def measure(impl: str, args) -> dict:
    command = [PYTHON[impl], str(HERE / "train_step.py"), "--impl", impl, "--mode", args.mode, "--dtype", args.dtype,
               "--steps", str(args.steps)] + (["--compile"] if args.compile else [])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def matmul_tflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", choices=["hf", "torchtune"], default="hf")
    parser.add_argument("--mode", choices=["full", "lora", "qlora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.peer == "torchtune" and not Path(PYTHON["torchtune"]).exists():
        raise SystemExit("the torchtune peer environment is missing: bash benchmarks/make_peer_env.sh")
    ratios, ours_runs = [], []
    for i in range(args.pairs):
        ours, peer = measure("ours", args), measure(args.peer, args)
        ours_runs.append(ours)
        ratios.append(ours["tokens_per_second"] / peer["tokens_per_second"])
        print(f"pair {i + 1}: ours {ours['tokens_per_second']:.0f} tok/s ({ours['peak_rss_mib']:.0f} MiB), "
              f"{NAMES[args.peer]} {peer['tokens_per_second']:.0f} tok/s ({peer['peak_rss_mib']:.0f} MiB), "
              f"ratio {ratios[-1]:.2f}", flush=True)
        with open(HERE / "results.jsonl", "a") as log:
            log.write(json.dumps({"pair": i + 1, "ours": ours, "peer": peer, "ratio": ratios[-1]}) + "\n")
    peak = matmul_tflops(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tokens_per_second = statistics.median(r["tokens_per_second"] for r in ours_runs)
    params = 4_196_608  # the default tiny Llama shape
    flops_per_token = (6 if args.mode == "full" else 4) * params
    label = f"{args.mode}, {args.dtype}{', compiled' if args.compile else ''}"
    print(f"median ratio ours / {NAMES[args.peer]} ({label}): {statistics.median(ratios):.2f}")
    print(f"machine matmul {peak:.2f} TFLOP/s {args.dtype}; our step achieves {tokens_per_second * flops_per_token / 1e12 / peak:.1%} of it")


if __name__ == "__main__":
    main()
