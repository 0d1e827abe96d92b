"""One table of what only a GPU can show: bf16 LoRA and QLoRA training steps of a 1B-shaped Llama (Llama 3.2 1B's
shapes, random weights, no download), eager and compiled, with and without activation offloading: peak memory
against the planner's prediction, tokens/s and model-FLOPs utilisation (MFU); then our reference NF4 quantiser against
torchao's on the GPU (same codes, time).

    python benchmarks/gpu_check.py                 # on a CUDA machine: about 5 minutes on one H100-class GPU
    python benchmarks/gpu_check.py --dry-run       # anywhere: the tiny Llama on CPU, 2 steps, no compile

MFU = model FLOPs per second / the device's peak: dense bf16 tensor-core peak from --peak-tflops, or from a table of
known GPUs; with --dry-run, the bf16 matmul rate measured here. Model FLOPs per token: 2 N forward, 2 N for the
activation gradients, + 2 N_trained for the weight gradients, + attention's 4 L s d_attn forward (x3 with backward).
"""
import argparse
import contextlib
import time
import warnings

import torch

from torchtune_lit.models.llama3_2 import lora_llama3_2_1b, qlora_llama3_2_1b
from torchtune_lit.models.tiny import lora_tiny_llama, qlora_tiny_llama
from torchtune_lit.modules.low_precision.nf4 import nf4_dequantize, nf4_quantize, to_nf4
from torchtune_lit.modules.peft import get_adapter_params, set_trainable_params
from torchtune_lit.training import summed_cross_entropy
from torchtune_lit.training.memory import OffloadActivations, estimate_training_memory, measure_step_peak

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}
LORA = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=16,
            lora_alpha=32)


def peak_tflops(device: torch.device, given: float) -> float:
    if given:
        return given
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_BF16_TFLOPS.items():
            if key in name:
                return value
        raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (dense bf16)")
    n = 512   # a dry run only: a CPU that emulates bf16 (AVX2) does 2048^3 in ~13 s
    a = torch.randn(n, n, dtype=torch.bfloat16)
    a @ a
    start = time.perf_counter()
    for _ in range(3):
        a @ a
    return 3 * 2 * n**3 / (time.perf_counter() - start) / 1e12


def build(mode: str, dry_run: bool, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    builder = {("lora", True): lora_tiny_llama, ("qlora", True): qlora_tiny_llama,
               ("lora", False): lora_llama3_2_1b, ("qlora", False): qlora_llama3_2_1b}[mode, dry_run]
    with torch.device(device):
        model = builder(**LORA).to(torch.bfloat16)
    set_trainable_params(model, get_adapter_params(model))
    return model


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    attn = model.layers[0].attn
    attention = 4 * len(model.layers) * seq_len * attn.num_heads * attn.head_dim
    return 4 * total + 2 * trained + 3 * attention


def train_case(mode: str, compiled: bool, offload: bool, args, device: torch.device, peak: float) -> dict:
    model = build(mode, args.dry_run, device)
    if compiled:
        for layer in model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.tok_embeddings.num_embeddings
    tokens = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    context = OffloadActivations(device) if offload else contextlib.nullcontext()

    def step():
        with context:
            loss = summed_cross_entropy(model(tokens), tokens) / tokens.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    measured = torch.cuda.max_memory_allocated() if device.type == "cuda" else measure_step_peak(step, model,
                                                                                                    optimizer)
    planned = estimate_training_memory(model, args.batch, args.seq, torch.bfloat16, device=device,
                                       activation_offloading=offload and device.type == "cuda")
    tokens_per_second = args.batch * args.seq / seconds
    mfu = tokens_per_second * model_flops_per_token(model, args.seq) / (peak * 1e12)
    return dict(case=f"{mode}{' compiled' if compiled else ''}{' offload' if offload else ''}",
                measured=measured / 2**20, planned=planned.total / 2**20, tps=tokens_per_second, mfu=mfu)


def nf4_check(device: torch.device, dry_run: bool) -> str:
    size = 512 if dry_run else 4096
    weight = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    start = time.perf_counter()
    ours = nf4_dequantize(nf4_quantize(weight))
    ours_seconds = time.perf_counter() - start
    start = time.perf_counter()
    theirs = to_nf4(weight).get_original_weight()
    torchao_seconds = time.perf_counter() - start
    difference = (ours.to(device).float() - theirs.float()).abs().max().item()
    return (f"NF4 of a {size}x{size} bf16 weight on {device.type}: ours vs torchao max |difference| "
            f"{difference:.2e}; {ours_seconds * 1e3:.0f} ms (the book's reference, chunked) vs "
            f"{torchao_seconds * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny Llama on CPU, 2 steps, no compile")
    parser.add_argument("--peak-tflops", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run")
    defaults = dict(batch=2, seq=64, steps=2, warmup=1) if args.dry_run else dict(batch=4, seq=2048, steps=10,
                                                                                   warmup=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    peak = peak_tflops(device, args.peak_tflops)
    cases = [("lora", False, False), ("qlora", False, False), ("lora", True, False), ("qlora", True, False),
             ("lora", False, True)]
    if args.dry_run:
        cases = [c for c in cases if not c[1]]   # no compile in a dry run
    with warnings.catch_warnings():   # a dry run's offloading says, once per case, that a CPU has nothing to offload
        warnings.simplefilter("ignore" if args.dry_run else "default")
        rows = [train_case(mode, compiled, offload, args, device, peak) for mode, compiled, offload in cases]
    shape = "tiny Llama" if args.dry_run else "Llama 3.2 1B shapes"
    print(f"{shape}, bf16, batch {args.batch} x {args.seq} tokens, {device.type}, peak {peak:.1f} TFLOP/s")
    print(f"{'case':24} {'peak MiB':>9} {'planned':>8} {'tokens/s':>10} {'MFU':>6}")
    for r in rows:
        print(f"{r['case']:24} {r['measured']:9.1f} {r['planned']:8.1f} {r['tps']:10.0f} {r['mfu']:6.1%}")
    print(nf4_check(device, args.dry_run))


if __name__ == "__main__":
    main()
