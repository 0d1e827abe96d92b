"""Tokens/s and peak memory of one training configuration: ours, transformers (+ peft) or torchtune 0.6.1; full / LoRA / QLoRA.

    python benchmarks/train_step.py --impl ours --mode lora --dtype bf16          # prints one JSON line

Forward + backward + AdamW step on random tokens of a Llama shape given on the command line (default: the tiny
Llama, vocab 2048, 4 layers, dim 256, 8 heads, 4 kv heads, ffn 768) at batch 8 x 256; the median step time after
warm-up. `--docs K` packs K documents of random lengths into every row (a block-causal mask, positions restarting
at each document), each library taking it its own way: ours and torchtune a boolean [batch, seq, seq] mask with
`input_pos`, transformers a 4-D mask with `position_ids`. Both implementations get the same weights (ours is loaded from the transformers model through our
checkpoint converter), the same LoRA targets and rank, the same data and seed. Peak memory is the process's peak
resident set on CPU (the CUDA allocator's peak on GPU). `compare.py` runs two of these alternately.
"""
import argparse
import json
import resource
import statistics
import tempfile
import time

import torch


def hf_model(args):
    import transformers
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def torchtune_model(args):
    "torchtune 0.6.1's Llama 3 builders at the same shape (run from benchmarks/.venv-torchtune; seeded, own init)."
    from torchtune.models.llama3 import llama3, lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    shape = dict(vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                 embed_dim=args.dim, max_seq_len=args.seq, intermediate_dim=args.ffn, rope_base=10_000)
    torch.manual_seed(0)
    if args.mode == "full":
        return llama3(**shape)
    model = lora_llama3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=args.rank,
                        lora_alpha=2 * args.rank, quantize_base=args.mode == "qlora", **shape)
    set_trainable_params(model, get_adapter_params(model))
    return model


def build(args):
    "(model, trainable parameters, forward returning logits) for the chosen implementation and mode."
    if args.impl == "torchtune":
        model = torchtune_model(args).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        forward = torch.compile(model) if args.compile else model
        return model, [p for p in model.parameters() if p.requires_grad], forward
    reference = hf_model(args)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if args.impl == "hf":
        model = reference
        if args.mode != "full":
            import peft
            if args.mode == "qlora":
                raise SystemExit("transformers QLoRA needs bitsandbytes on CUDA; not measured on CPU")
            model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))
        forward = lambda tokens, **inputs: model(tokens, **inputs).logits
    else:
        from torchtune_lit.models import build_from_hf_config
        from torchtune_lit.models.convert_weights import hf_to_tune
        from torchtune_lit.modules.peft import apply_lora, get_adapter_params, set_trainable_params
        model = build_from_hf_config(reference.config.to_dict())
        state = hf_to_tune(reference.state_dict(), args.heads, args.kv_heads, args.dim)
        model.load_state_dict(state)
        if args.mode != "full":
            model = apply_lora(model, ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                               lora_rank=args.rank, lora_alpha=2 * args.rank, quantize_base=args.mode == "qlora")
            set_trainable_params(model, get_adapter_params(model))
        forward = model
    model = model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    if args.compile:
        forward = torch.compile(forward)
    return model, [p for p in model.parameters() if p.requires_grad], forward


def packed_rows(batch: int, seq: int, docs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    "Block-causal mask [batch, seq, seq] and positions [batch, seq] for rows of `docs` documents of random lengths."
    masks, positions = [], []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=gen)[: docs - 1].add(1).sort().values.tolist()
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        masks.append((doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())
    return torch.stack(masks), torch.stack(positions)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ours", "hf", "torchtune"], default="ours")
    parser.add_argument("--mode", choices=["full", "lora", "qlora"], default="full")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--compile", action="store_true")
    for name, default in [("vocab", 2048), ("layers", 4), ("dim", 256), ("heads", 8), ("kv_heads", 4), ("ffn", 768),
                          ("batch", 8), ("seq", 256), ("rank", 8), ("warmup", 3), ("steps", 10), ("docs", 0)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    model, params, forward = build(args)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    inputs = {}
    if args.docs > 1:
        mask, positions = packed_rows(args.batch, args.seq, args.docs, gen)
        if args.impl == "hf":
            inputs = {"attention_mask": mask[:, None], "position_ids": positions}
        else:
            inputs = {"mask": mask, "input_pos": positions}
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        logits = forward(tokens[:, :-1], **inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({"impl": args.impl, "mode": args.mode, "dtype": args.dtype, "compile": args.compile,
                      "seq": args.seq, "batch": args.batch, "docs": args.docs,
                      "tokens_per_second": args.batch * args.seq / median, "step_seconds": median,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "trainable_parameters": sum(p.numel() for p in params), "final_loss": loss.item()}))


if __name__ == "__main__":
    main()
