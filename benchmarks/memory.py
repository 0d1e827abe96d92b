"""Peak memory and tokens/s of one training step at real model shapes: ours, torchtune 0.6.1, transformers + PEFT.

    python benchmarks/memory.py --quick          # SmolLM2-135M, LoRA, fp32, sequence 2,048: one JSON line per library
    python benchmarks/memory.py                  # the scaling table: sequence 512 -> 4,096, three shapes, LoRA and full
    python benchmarks/memory.py --shapes smollm2-135m --modes lora --seqs 2048 --dtype bf16 --pairs 2
    python benchmarks/memory.py --table          # the markdown table of the rows in benchmarks/memory.jsonl

Each measurement is a fresh process (this file with `--worker`), so one library's allocations never count against
another's. A worker builds the model at the named shape with random weights (the real architecture: sizes, tied
embeddings, Qwen's q/k/v biases; no download), runs one warm-up step and `--steps` timed steps of forward, loss,
backward and AdamW at batch 1, and prints one JSON line:

- `peak_rss_mb`: the process's peak resident set (`ru_maxrss`), everything the process held: the interpreter,
  PyTorch (`import_rss_mb`, measured right after `import torch`), the library's own imports, the weights, and the
  step's activations, logits, gradients and optimizer states; the ratios compare this number;
- `step_peak_mb` = `peak_rss_mb - import_rss_mb`: what the library, the model and the step added to PyTorch;
- `tok_per_s`: tokens of one step over the median time of the timed steps;
- ours only: `planner_mb`, `estimate_training_memory` for the same model, loss and levers, and `tensor_peak_mb`,
  the bytes of live tensors at the peak of one more step (`training.memory.PeakMemory`, after the timing), which is
  what the planner models; the rest of `step_peak_mb` is the library's imports and the C heap's retention.

Each library runs the way its own documentation recommends for memory:

- **torchtune 0.6.1** (from `benchmarks/.venv-torchtune`, built by `make_peer_env.sh`): its recipe's pieces,
  `CEWithChunkedOutputLoss` with `model.set_num_output_chunks(8)` and `training.set_activation_checkpointing` on
  every `TransformerSelfAttentionLayer`; the SmolLM2 shape through its `lora_llama3_2` / `llama3_2` component
  builders, Qwen2.5-0.5B and Llama-3.2-1B through their named builders.
- **transformers + PEFT**: `gradient_checkpointing_enable(use_reentrant=False)`, the loss computed by the model
  from `labels` (its own `ForCausalLMLoss`), LoRA through `peft.get_peft_model`. Liger's fused linear
  cross-entropy was not used: `liger-kernel` installs from the registry but its kernels are Triton kernels, which
  need a GPU.
- **ours**: `LinearCrossEntropyLoss` (the output projection applied inside the loss, chunk by chunk, its gradient
  taken in the forward pass), `training.set_activation_checkpointing` and `training.release_memory_between_layers`
  (glibc's `malloc_trim` before each layer, so freed heap pages go back to the operating system).

LoRA everywhere: rank 8, alpha 16, on q, k, v, output and the three MLP projections; AdamW on what trains.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = {"ours": sys.executable, "hf": sys.executable, "torchtune": str(HERE / ".venv-torchtune" / "bin" / "python")}
# Hugging Face config.json fields of the real checkpoints (random weights are built from these)
SHAPES = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
RANK, ALPHA = 8, 16
LORA_ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rss_mb() -> float:
    "Peak resident set of this process so far, MiB (Linux reports ru_maxrss in KiB)."
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def init_like_hf(model) -> None:
    "Normal(0, 0.02) matrices, as transformers initialises a Llama (LoRA's B stays 0): a first loss near ln(vocab)."
    import torch
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "lora_" not in name:
            torch.nn.init.normal_(p, std=0.02)


def build_ours(shape: dict, mode: str, dtype, seq: int):
    "(model, trainable parameters, step function, planner prediction in bytes)."
    import torchtune_lit.training as training
    from torchtune_lit.models import build_from_hf_config
    from torchtune_lit.modules.loss import LinearCrossEntropyLoss
    from torchtune_lit.modules.peft import apply_lora, get_adapter_params, set_trainable_params
    from torchtune_lit.training.memory import estimate_training_memory
    model = build_from_hf_config({k: v for k, v in shape.items() if k != "name"})
    init_like_hf(model)
    if mode == "lora":
        model = apply_lora(model, LORA_ATTN, apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA)
        set_trainable_params(model, get_adapter_params(model))
    model = model.to(dtype)
    training.set_activation_checkpointing(model)
    training.release_memory_between_layers(model)
    loss_fn = LinearCrossEntropyLoss()
    loss_fn.set_model_output(model)
    predicted = estimate_training_memory(model, 1, seq, dtype=dtype, activation_checkpointing=True,
                                         loss_fn=loss_fn).total

    def step(tokens, labels):
        return loss_fn(model(tokens), labels)
    return model, step, predicted


def build_torchtune(shape: dict, mode: str, dtype, seq: int):
    "torchtune 0.6.1's builders and its recipe's memory pieces."
    from torchtune import modules, training
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    lora = dict(lora_attn_modules=LORA_ATTN, apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA)
    if shape["name"] == "qwen2.5-0.5b":
        from torchtune.models.qwen2_5 import lora_qwen2_5_0_5b, qwen2_5_0_5b
        model = lora_qwen2_5_0_5b(**lora) if mode == "lora" else qwen2_5_0_5b()
    else:
        from torchtune.models.llama3_2 import _component_builders as builders
        sizes = dict(vocab_size=shape["vocab_size"], num_layers=shape["num_hidden_layers"],
                     num_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"],
                     embed_dim=shape["hidden_size"], max_seq_len=shape["max_position_embeddings"],
                     intermediate_dim=shape["intermediate_size"], norm_eps=shape["rms_norm_eps"],
                     rope_base=int(shape["rope_theta"]))
        model = builders.lora_llama3_2(**lora, **sizes) if mode == "lora" else builders.llama3_2(**sizes)
    init_like_hf(model)
    if mode == "lora":
        set_trainable_params(model, get_adapter_params(model))
    model = model.to(dtype)
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)

    def step(tokens, labels):
        return loss_fn(model(tokens), labels)
    return model, step, None


def build_hf(shape: dict, mode: str, dtype, seq: int):
    "transformers' model with gradient checkpointing, PEFT's LoRA, the model's own loss."
    import peft
    import transformers
    config = transformers.AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "name"})
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if mode == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS))
    model.train()

    def step(tokens, labels):
        return model(input_ids=tokens, labels=labels).loss
    return model, step, None


def worker(args) -> None:
    "One library, one row: build, warm up, time, print one JSON line."
    import torch
    torch.manual_seed(0)
    import_rss = rss_mb()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    shape = {**SHAPES[args.shape], "name": args.shape}
    build = {"ours": build_ours, "torchtune": build_torchtune, "hf": build_hf}[args.lib]
    model, step, predicted = build(shape, args.mode, dtype, args.seq)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, shape["vocab_size"], (1, args.seq + 1), generator=gen)
    tokens, labels = data[:, :-1], data[:, 1:]
    if args.lib == "hf":
        labels = data[:, :-1]  # transformers shifts the labels itself
    times, losses = [], []
    for index in range(1 + args.steps):
        start = time.perf_counter()
        loss = step(tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if index > 0:
            times.append(time.perf_counter() - start)
    peak = rss_mb()
    tensor_peak = None
    if predicted is not None:  # one more step, its tensors counted (after the timing)
        from torchtune_lit.training.memory import measure_step_peak

        def counted_step():
            step(tokens, labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tensor_peak = measure_step_peak(counted_step, model, optimizer)
    row = {"lib": args.lib, "shape": args.shape, "mode": args.mode, "dtype": args.dtype, "seq": args.seq,
           "peak_rss_mb": round(peak), "import_rss_mb": round(import_rss), "step_peak_mb": round(peak - import_rss),
           "tok_per_s": round(args.seq / statistics.median(times), 1), "loss": round(losses[-1], 4),
           "trainable": sum(p.numel() for p in params)}
    if predicted is not None:
        row["tensor_peak_mb"] = round(tensor_peak / 2**20)
        row["planner_mb"] = round(predicted / 2**20)
    print(json.dumps(row), flush=True)


def measure(lib: str, shape: str, mode: str, seq: int, args) -> dict:
    "Run one worker process; its JSON line as a dict."
    command = [PYTHON[lib], str(Path(__file__).resolve()), "--worker", "--lib", lib, "--shape", shape,
               "--mode", mode, "--seq", str(seq), "--dtype", args.dtype, "--steps", str(args.steps)]
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    result = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{lib} {shape} {mode} seq={seq} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    """A markdown table of measured rows: per shape, mode, dtype and sequence length, each library's peak resident
    memory and tokens/s (the median over its runs: `--pairs`), ours against the peer with the lowest peak, and the
    planner against our live tensors."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for row in rows:
        key = (row["shape"], row["mode"], row["dtype"], row["seq"])
        groups.setdefault(key, {}).setdefault(row["lib"], []).append(row)
    lines = ["| shape, mode, dtype | seq | runs | peak RSS MB: ours / torchtune / transformers | ours / lowest peer | "
             "tok/s: ours / torchtune / transformers | ours / that peer | planner / our live tensors MB |",
             "|---|---|---|---|---|---|---|---|"]
    for (shape, mode, dtype, seq), libs in groups.items():
        if set(libs) != {"ours", "torchtune", "hf"}:
            continue
        med = {lib: {k: statistics.median(r[k] for r in runs) for k in ("peak_rss_mb", "tok_per_s")}
               for lib, runs in libs.items()}
        best = min(("torchtune", "hf"), key=lambda lib: med[lib]["peak_rss_mb"])
        peaks = " / ".join(f"{med[k]['peak_rss_mb']:,.0f}" for k in ("ours", "torchtune", "hf"))
        speeds = " / ".join(f"{med[k]['tok_per_s']:.0f}" for k in ("ours", "torchtune", "hf"))
        ours = libs["ours"][-1]
        lines.append(f"| {shape}, {mode}, {dtype} | {seq:,} | {len(libs['ours'])} | {peaks} | "
                     f"**{med['ours']['peak_rss_mb'] / med[best]['peak_rss_mb']:.2f}x** | {speeds} | "
                     f"**{med['ours']['tok_per_s'] / med[best]['tok_per_s']:.2f}x** | "
                     f"{ours['planner_mb']:,} / {ours['tensor_peak_mb']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="SmolLM2-135M, LoRA, fp32, sequence 2,048")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", choices=["ours", "torchtune", "hf"], default="ours")
    parser.add_argument("--libs", nargs="+", default=["ours", "torchtune", "hf"])
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--modes", nargs="+", default=["lora", "full"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--seqs", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=1, help="runs of every library per row, alternating")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="run every library with glibc's MALLOC_MMAP_THRESHOLD_ set to this many bytes")
    parser.add_argument("--out", default=str(HERE / "memory.jsonl"))
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out's rows and stop")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.table:
        print(table([json.loads(line) for line in open(args.out)]))
        return
    if args.quick:
        args.shapes, args.modes, args.seqs = ["smollm2-135m"], ["lora"], [2048]
    if "torchtune" in args.libs and not Path(PYTHON["torchtune"]).exists():
        raise SystemExit("no benchmarks/.venv-torchtune: run `bash benchmarks/make_peer_env.sh` once "
                         "(or pass --libs ours hf)")
    for shape in args.shapes:
        for mode in args.modes:
            for seq in args.seqs:
                for _ in range(args.pairs):
                    for lib in args.libs:
                        row = measure(lib, shape, mode, seq, args)
                        print(json.dumps(row), flush=True)
                        if not args.quick:
                            with open(args.out, "a") as out:
                                out.write(json.dumps({**row, "time": time.strftime("%Y-%m-%d %H:%M")}) + "\n")


if __name__ == "__main__":
    main()
