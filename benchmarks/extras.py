"""The other measurements of the benchmarks issue, each in a fresh process, printed as JSON lines:

    python benchmarks/extras.py generation   # greedy tokens/s with the KV cache at batch 1: ours vs transformers' generate
    python benchmarks/extras.py generation_batch8   # the same at batch 8
    python benchmarks/extras.py ce_memory    # peak RSS of chunked vs naive cross-entropy at vocabulary 128,256
    python benchmarks/extras.py nf4_time     # NF4 quantization of a 4096 x 4096 weight: ours vs torchao's to_nf4
    python benchmarks/extras.py attention    # causal SDPA forward + backward on CPU: bf16 vs fp32, over sequence lengths
    python benchmarks/extras.py all          # all of them (each side of each in its own process)
"""
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def generation(impl: str, new_tokens: int = 128, batch: int = 1, repeats: int = 3) -> dict:
    "Greedy decoding of `new_tokens` after a 32-token prompt on the tiny Llama shape, same weights both sides, fp32."
    import transformers
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 2048, (batch, 32), generator=torch.Generator().manual_seed(0))
    if impl == "ours":
        from torchtune_lit.generation import generate
        from torchtune_lit.models import build_from_hf_config
        from torchtune_lit.models.convert_weights import hf_to_tune
        model = build_from_hf_config(config.to_dict())
        model.load_state_dict(hf_to_tune(hf.state_dict(), 8, 4, 256))
        run = lambda: generate(model, prompt, new_tokens)
    else:
        run = lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        run()                                                   # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
    return {"measure": "generation", "impl": impl, "batch": batch,
            "tokens_per_second": batch * new_tokens / statistics.median(times)}


def generation_batch8(impl: str) -> dict:
    "Greedy decoding as `generation`, eight prompts at once."
    return generation(impl, batch=8)


def ce_memory(impl: str, vocab: int = 128_256, tokens: int = 1024, chunks: int = 8) -> dict:
    "Peak RSS growth of forward+backward of the loss on bf16 logits [1, tokens, vocab]: naive fp32 CE vs chunked."
    import torch.nn.functional as F
    from torchtune_lit.modules.loss import CEWithChunkedOutputLoss
    hidden = torch.randn(1, tokens, 64, dtype=torch.bfloat16)
    head = torch.randn(vocab, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if impl == "naive":
        logits = hidden @ head.T
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    else:
        logits = [h @ head.T for h in hidden.chunk(chunks, dim=1)]
        loss = CEWithChunkedOutputLoss(chunks)(logits, labels)
    loss.backward()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"measure": "ce_memory", "impl": impl, "vocab": vocab, "tokens": tokens, "peak_rss_growth_mib": grown}


def nf4_time(impl: str, repeats: int = 5) -> dict:
    "Median seconds to quantize one 4096 x 4096 bf16 weight to NF4."
    weight = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if impl == "ours":
        from torchtune_lit.modules.low_precision.nf4 import nf4_quantize as quantize
    else:
        from torchao.quantization import to_nf4 as quantize
    quantize(weight)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        quantize(weight)
        times.append(time.perf_counter() - start)
    return {"measure": "nf4_time", "impl": impl, "seconds": statistics.median(times)}


def attention(impl: str, repeats: int = 6) -> dict:
    """Median ms of causal GQA SDPA forward + backward on bf16 inputs, run in bf16 or upcast to fp32, for head
    dimensions 32/64/128 and sequences 128-2048 at 2,048 tokens per batch: the sweep behind the attention chapter's
    CPU rule (fp32 up to 256 positions when seq_len x head_dim <= 16,384)."""
    import torch.nn.functional as F
    timings = {}
    for head_dim, heads in [(32, 8), (64, 16), (128, 8)]:
        for seq in [128, 256, 512, 1024, 2048]:
            batch = 2048 // seq
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(batch, heads, seq, head_dim, generator=gen).bfloat16().requires_grad_()
            k, v = (torch.randn(batch, heads // 2, seq, head_dim, generator=gen).bfloat16().requires_grad_() for _ in range(2))
            grad = torch.randn(batch, heads, seq, head_dim, generator=gen).bfloat16()
            cast = torch.float32 if impl == "fp32" else torch.bfloat16

            def run():
                out = F.scaled_dot_product_attention(q.to(cast), k.to(cast), v.to(cast), is_causal=True, enable_gqa=True)
                out.to(torch.bfloat16).backward(grad)
            run()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            timings[f"head_dim={head_dim},seq={seq}"] = round(1000 * statistics.median(times), 2)
    return {"measure": "attention", "impl": impl, "ms": timings}


MEASURES = {"attention": (attention, ["bf16", "fp32"]), "generation": (generation, ["ours", "transformers"]),
            "generation_batch8": (generation_batch8, ["ours", "transformers"]), "ce_memory": (ce_memory, ["chunked", "naive"]),
            "nf4_time": (nf4_time, ["ours", "torchao"])}


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if len(sys.argv) == 3:                                       # one side, in this process
        print(json.dumps(MEASURES[what][0](sys.argv[2])))
        return
    for name in (MEASURES if what == "all" else [what]):
        results = {}
        for impl in MEASURES[name][1] * 2:                       # A B A B: alternate, keep the second of each
            out = subprocess.run([sys.executable, __file__, name, impl], capture_output=True, text=True, check=True)
            results[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        for impl in MEASURES[name][1]:
            print(json.dumps(results[impl]), flush=True)
        if name == "attention":                                  # the ratio per shape: > 1 means fp32 is faster
            bf16, fp32 = results["bf16"]["ms"], results["fp32"]["ms"]
            print(json.dumps({"measure": "attention", "bf16_over_fp32": {k: round(bf16[k] / fp32[k], 2) for k in bf16}}))


if __name__ == "__main__":
    main()
