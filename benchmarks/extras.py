"""The other measurements of the benchmarks issue, each in a fresh process, printed as JSON lines:

    python benchmarks/extras.py generation   # greedy tokens/s with the KV cache: ours vs transformers' generate
    python benchmarks/extras.py ce_memory    # peak RSS of chunked vs naive cross-entropy at vocabulary 128,256
    python benchmarks/extras.py nf4_time     # NF4 quantization of a 4096 x 4096 weight: ours vs torchao's to_nf4
    python benchmarks/extras.py all          # all three (each side of each in its own process)
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
    return {"measure": "generation", "impl": impl, "tokens_per_second": batch * new_tokens / statistics.median(times)}


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


MEASURES = {"generation": (generation, ["ours", "transformers"]), "ce_memory": (ce_memory, ["chunked", "naive"]),
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


if __name__ == "__main__":
    main()
