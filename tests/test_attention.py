"""Attention fast paths: mask-free causal SDPA for pretraining, flex attention for packed SFT rows.

CPU, fp32, a tiny Llama built here. Both must give the outputs of the masked eager reference. The
compiled graph is inspected with a dynamo backend that records the SDPA calls (no C++ compile), and
flex attention runs forward only (its CPU kernel has no backward; tests/test_gpu_training_paths.py
checks the backward on a GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainpod.errors import InputError
from trainpod.train.model import CAUSAL_SDPA, causal_fast_path, resolve_attention

torch.set_num_threads(1)


def tiny_llama(attn: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def sdpa_calls_in_compiled_graph(model: LlamaForCausalLM, ids: torch.Tensor) -> list[tuple[bool, bool]]:
    """(an attention mask was passed, is_causal) for each SDPA call dynamo traced."""
    calls = []

    def recording_backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.target is torch._C._nn.scaled_dot_product_attention:
                calls.append((node.kwargs.get("attn_mask") is not None, node.kwargs.get("is_causal")))
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(model, backend=recording_backend)(input_ids=ids)
    return calls


def test_compiled_pretraining_model_calls_sdpa_causal_without_a_mask():
    ids = torch.randint(0, 256, (2, 16))
    assert sdpa_calls_in_compiled_graph(tiny_llama(causal_fast_path("sdpa")), ids) == [(False, True)] * 2


def test_plain_sdpa_under_compile_gets_a_dense_mask_which_is_why_the_fast_path_exists():
    ids = torch.randint(0, 256, (2, 16))
    assert sdpa_calls_in_compiled_graph(tiny_llama("sdpa"), ids) == [(True, False)] * 2, (
        "transformers now skips the mask under compile by itself; causal_fast_path may be unnecessary"
    )


def test_causal_fast_path_gives_the_masked_eager_outputs():
    ids = torch.randint(0, 256, (3, 24))
    with torch.no_grad():
        reference = tiny_llama("eager")(input_ids=ids).logits
        fast = tiny_llama(causal_fast_path("sdpa"))(input_ids=ids).logits
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)


def test_causal_fast_path_leaves_flash_attention_and_eager_alone():
    assert causal_fast_path("sdpa") == CAUSAL_SDPA
    assert causal_fast_path("flash_attention_2") == "flash_attention_2"
    assert causal_fast_path("eager") == "eager"


def test_packed_rows_on_a_gpu_without_flash_attn_use_sdpa_not_flex_attention(monkeypatch):
    # flex attention on packed rows was refused by the packing probe on the first GPU it met (an H100,
    # bench/results/gpu-2026-11-27/qlora-32b.json): every packed finetune on an image without flash-attn
    # ended in exit 2. SDPA with transformers' block-diagonal mask is the default; flex only when asked.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # stands in for an image without flash-attn (this machine has no GPU to ask)
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a),
    )
    cuda = torch.device("cuda")
    assert resolve_attention("auto", cuda) == "sdpa"
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attention("flex_attention", cuda) == "flex_attention"
    assert resolve_attention("eager", cuda) == "eager"


def test_flash_attention_asked_for_where_it_cannot_run_is_a_config_error(monkeypatch):
    # flash-attn is optional in the image (docker/Dockerfile); asked for without it, transformers raised
    # ImportError while the model was built: exit 1 at every start instead of exit 2.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # an image without flash-attn
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a),
    )
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        with pytest.raises(InputError, match=r"train.attention=flash_attention_2 needs flash-attn on a GPU"):
            resolve_attention("flash_attention_2", device)
    with pytest.raises(InputError, match=r"base_model.attention=flash_attention_2 .* no flash-attn package"):
        resolve_attention("flash_attention_2", torch.device("cuda", 0), field="base_model.attention")
    monkeypatch.setattr(  # an image with it
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a),
    )
    assert resolve_attention("flash_attention_2", torch.device("cuda", 0)) == "flash_attention_2"


def test_heads_wider_than_flash_attns_kernels_get_sdpa_or_a_config_error(monkeypatch):
    # hidden_size 4096 over 8 heads is 512 dimensions a head: flash-attn 2 stops at 256 and failed at the
    # first step, on every start, when `auto` picked it.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # an image with flash-attn
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a),
    )
    cuda = torch.device("cuda", 0)
    assert resolve_attention("auto", cuda, head_dim=256) == "flash_attention_2"
    assert resolve_attention("auto", cuda, head_dim=512) == "sdpa"
    with pytest.raises(InputError, match=r"train.attention=flash_attention_2 .* heads have 512 dimensions"):
        resolve_attention("flash_attention_2", cuda, head_dim=512)


def test_flex_attention_on_packed_rows_equals_the_masked_reference_and_each_sample_alone(monkeypatch):
    # What this checks is ours: the document mask transformers builds from the packed position ids. Its
    # kernel runs uncompiled here, because inductor's CPU flex-attention kernel gave wrong results on an
    # AVX2-only machine (AMD EPYC, torch 2.13: up to 3.0 off the uncompiled one, changing from run to
    # run), a torch bug outside our code. The product runs flex attention on CUDA only, where the GPU
    # tier checks the compiled kernel (test_gpu_training_paths.py).
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as transformers_flex

    monkeypatch.setattr(transformers_flex.WrappedFlexAttention, "__call__", lambda self: flex_attention)
    ids = torch.randint(0, 256, (2, 24))
    positions = torch.tensor(
        [list(range(10)) + list(range(14)), list(range(5)) + list(range(12)) + list(range(7))]
    )
    with torch.no_grad():
        reference = tiny_llama("eager")(input_ids=ids, position_ids=positions).logits
        alone = tiny_llama("eager")(input_ids=ids[1:, 5:17]).logits
        flex = tiny_llama("flex_attention")(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(flex, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flex[1, 5:17], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn", [CAUSAL_SDPA])
def test_a_model_trained_on_the_fast_path_saves_a_config_that_loads_anywhere(attn, tmp_path):
    causal_fast_path("sdpa")
    tiny_llama(attn).save_pretrained(tmp_path)
    assert CAUSAL_SDPA not in (tmp_path / "config.json").read_text()
    LlamaForCausalLM.from_pretrained(tmp_path)


def test_auto_picks_an_attention_the_model_implements_and_one_it_lacks_is_a_config_error(
    monkeypatch, tmp_path
):
    # Gemma 2 (and gpt-oss) implement no SDPA: `auto` chose it, and transformers raised ValueError loading
    # the model, exit 1 at every start of a finetune of one.
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from trainpod.config.finetune import BaseModelConfig
    from trainpod.train.base_model import supported_attention

    config = Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    supported = supported_attention(tmp_path / "gemma2", BaseModelConfig(path=str(tmp_path / "gemma2")))
    assert supported == {"eager", "flash_attention_2", "flex_attention"}

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # an image without flash-attn
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a),
    )
    assert resolve_attention("auto", torch.device("cpu"), supported=supported) == "eager"
    assert resolve_attention("auto", torch.device("cuda", 0), supported=supported) == "flex_attention"
    assert resolve_attention("auto", torch.device("cpu"), supported=supported | {"sdpa"}) == "sdpa"
    with pytest.raises(InputError, match=r"base_model.attention=sdpa: the model does not implement it"):
        resolve_attention("sdpa", torch.device("cpu"), field="base_model.attention", supported=supported)
