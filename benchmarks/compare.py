"""Run ours and a peer alternately (A B A B ...) in one session and print the ratio per pair and its median.

    python benchmarks/compare.py --mode lora --dtype bf16 --pairs 3      # ours vs transformers + peft

Each measurement is a fresh process (train_step.py), so neither side inherits the other's caches; alternating
spreads the noise of a shared machine over both sides. Also prints the machine's matmul throughput (2048^3) and the
fraction of it our step achieves (model FLOPs per step ~ 6 x parameters x tokens for full fine-tuning, ~ 4x for
frozen-base LoRA, divided by the step time).
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


def measure(impl: str, args) -> dict:
    command = [sys.executable, str(HERE / "train_step.py"), "--impl", impl, "--mode", args.mode, "--dtype", args.dtype,
               "--steps", str(args.steps)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def matmul_tflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["full", "lora"], default="lora")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    ratios, ours_runs = [], []
    for i in range(args.pairs):
        ours, peer = measure("ours", args), measure("hf", args)
        ours_runs.append(ours)
        ratios.append(ours["tokens_per_second"] / peer["tokens_per_second"])
        print(f"pair {i + 1}: ours {ours['tokens_per_second']:.0f} tok/s ({ours['peak_rss_mib']:.0f} MiB), "
              f"transformers+peft {peer['tokens_per_second']:.0f} tok/s ({peer['peak_rss_mib']:.0f} MiB), ratio {ratios[-1]:.2f}")
    peak = matmul_tflops(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tokens_per_second = statistics.median(r["tokens_per_second"] for r in ours_runs)
    params = 4_196_608  # the default tiny Llama shape
    flops_per_token = (6 if args.mode == "full" else 4) * params
    print(f"median ratio ours / transformers+peft ({args.mode}, {args.dtype}): {statistics.median(ratios):.2f}")
    print(f"machine matmul {peak:.2f} TFLOP/s {args.dtype}; our step achieves {tokens_per_second * flops_per_token / 1e12 / peak:.1%} of it")


if __name__ == "__main__":
    main()
