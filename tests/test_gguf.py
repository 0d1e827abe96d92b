"""GGUF export (chapter 86b): files that transformers' GGUF loader reads with our logits. The model here is the
tiny base perturbed in fp32 and saved by the checkpointer, so F16 really rounds (the shipped weights are bf16, which
F16 holds all but exactly) and the folder is what a recipe writes."""
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from torchtune_lit.datasets._tiny_world import TINY_ASSETS  # noqa: E402
from torchtune_lit.recipes.export_gguf import write_gguf  # noqa: E402
from torchtune_lit.training.checkpointing import (  # noqa: E402
    FullModelHFCheckpointer,
    load_model_for_eval,
)

TOKENS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    "A folder the checkpointer saved (weights, config, tokenizer) of an fp32 model, and its logits."
    out = tmp_path_factory.mktemp("gguf")
    checkpointer = FullModelHFCheckpointer(TINY_ASSETS / "base", output_dir=out)
    state = checkpointer.load_checkpoint()
    g = torch.Generator().manual_seed(0)
    state["model"] = {
        k: v.float() + 0.01 * torch.randn(v.shape, generator=g) for k, v in state["model"].items()
    }
    folder = checkpointer.save_checkpoint(state, epoch=0)
    model = load_model_for_eval(FullModelHFCheckpointer(folder), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        return folder, model, model(TOKENS)


def transformers_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        return model(TOKENS).logits


def test_f16_gguf_loads_in_transformers_with_our_logits(saved):
    "Within 1e-3 of our model on the weights the file holds (matrices rounded to fp16, norms fp32)."
    folder, model, ours = saved
    path = write_gguf(folder, folder.parent / "tiny-F16.gguf", "F16")
    theirs = transformers_logits(path)
    rounded = {k: v.half().float() if v.ndim == 2 else v for k, v in model.state_dict().items()}
    with torch.no_grad():
        original = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(rounded)
        ours_f16 = model(TOKENS)
        model.load_state_dict(original)
    assert not torch.equal(ours_f16, ours)  # F16 did round the fp32 weights
    torch.testing.assert_close(theirs, ours_f16, atol=1e-3, rtol=1e-3)
    # and F16's own rounding moves the fp32 model's logits by well under 1% of their spread
    assert (theirs - ours).abs().max() / ours.std() < 0.01


def test_q8_0_gguf_changes_logits_by_a_few_percent_of_their_spread(saved):
    folder, _, ours = saved
    path = write_gguf(folder, folder.parent / "tiny-Q8_0.gguf", "Q8_0")
    change = (transformers_logits(path) - ours).abs().max() / ours.std()
    assert 0 < change < 0.05
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.3.attn_q.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0


def test_a_family_without_a_gguf_writer_is_refused_in_one_line(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(ValueError, match="writes Llama-family models .* is a 'qwen2' model"):
        write_gguf(tmp_path / "qwen2", tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


# Llama 3's pre-tokenizer split (its tokenizer.json's Split pattern), for a byte-level BPE trained here
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_byte_level_bpe_tokenizer_gives_our_ids_and_logits(tmp_path):
    "A Llama 3-style byte-level BPE is written as llama.cpp's gpt2/llama-bpe tokenizer: transformers reads our ids."
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["The column holds dates, e-mails and 12345 numbers.", "Which type? date", "héllo wörld\nline"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )
    hf_model = transformers.LlamaForCausalLM(config)
    hf_model.save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    path = write_gguf(tmp_path, tmp_path / "bpe.gguf", "F32")
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["The column holds dates", " leading space", "héllo wörld 123456\nx", "e-mails: a@b.c"]:
        assert theirs(text, add_special_tokens=False).input_ids == fast(text, add_special_tokens=False).input_ids
    tokens = torch.randint(0, len(fast), (1, 12))
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(
            from_gguf(tokens).logits, hf_model(tokens).logits, atol=1e-4, rtol=1e-4
        )


def test_llama3_rope_and_tied_embeddings_are_written_as_llama_cpp_reads_them(tmp_path):
    "Llama 3.2's shape: rope_freqs holds transformers' plain/llama3 frequency ratio, and no output.weight (tied)."
    import shutil

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, rope_parameters=rope,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_ASSETS / "base" / name, tmp_path / name)
    reader = gguf.GGUFReader(write_gguf(tmp_path, tmp_path / "t.gguf", "Q8_0"))
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "token_embd.weight" in tensors
    llama3 = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]
    plain = 1 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32)
    written = torch.from_numpy(tensors["rope_freqs.weight"].data.copy())
    torch.testing.assert_close(written, plain / llama3, rtol=1e-5, atol=0)
    assert tensors["rope_freqs.weight"].tensor_type.name == "F32"


def test_an_export_that_fails_while_writing_leaves_no_file(tmp_path, monkeypatch):
    "The recipe writes next to the final name and renames: a failure once the header is on disk leaves nothing."
    seen = []

    def failing_write(writer, *args, **kwargs):
        seen.extend(p.name for p in tmp_path.iterdir())  # the header is already written
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", failing_write)
    with pytest.raises(OSError, match="No space left"):
        write_gguf(TINY_ASSETS / "base", tmp_path / "tiny.gguf", "F16")
    assert seen == [".tiny.gguf.tmp"] and list(tmp_path.iterdir()) == []
