"""The deferred (meta-device) initialisation of a sharded worker's model: every tensor made
alone, bit for bit as a CPU build makes it, the random stream left where that build leaves it,
and a model that cannot be deferred refused by name (then built whole)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lowcomm.models import ModelConfig, build_model
from lowcomm.models.deferred import NotDeferrable, build_deferred


def _config(family: str, **shape: object) -> ModelConfig:
    config = ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)
    config.family = family
    for name, value in shape.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize(
    "config",
    [
        _config("gpt"),
        _config("hf-llama", n_kv_head=2),  # tied embeddings (the default)
        _config("hf-llama", n_kv_head=2, tie_embeddings=False),
        _config("hf-gpt2"),
    ],
    ids=["gpt", "llama-tied", "llama", "gpt2"],
)
@pytest.mark.parametrize("shadow_elements", [16, 1 << 16], ids=["replayed", "shadowed"])
def test_every_tensor_is_the_cpu_builds(config: ModelConfig, shadow_elements: int) -> None:
    torch.manual_seed(5)
    whole = build_model(config, 64)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    model, deferred = build_deferred(lambda: build_model(config, 64), shadow_elements)
    assert torch.equal(torch.get_rng_state(), after)  # the stream goes on as after a CPU build
    assert all(p.is_meta for p in model.parameters())
    tensors = dict(whole.named_parameters(remove_duplicate=False))
    tensors.update(dict(whole.named_buffers()))
    assert set(tensors) == set(deferred.tensors)
    for name, tensor in tensors.items():
        assert torch.equal(deferred.rows(name), tensor.detach()), name
        rows = tensor.shape[0] if tensor.dim() else 0
        if rows > 2:  # any rows of it, the generator untouched
            assert torch.equal(deferred.rows(name, 1, rows - 1), tensor.detach()[1 : rows - 1])
    assert torch.equal(torch.get_rng_state(), after)


class _Scaled(nn.Module):
    """A parameter computed out of place from a large random tensor: not deferrable."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(300, 300) * 2)


def test_a_model_written_out_of_place_is_refused_by_name_and_built_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(NotDeferrable, match=r"weight is computed by aten\.mul"):
        build_deferred(_Scaled, shadow_elements=16)
    from lowcomm.config import TrainConfig
    from lowcomm.train.sharding import initial_model

    torch.manual_seed(1)
    want = _Scaled().weight
    torch.manual_seed(1)
    model, deferred = initial_model(TrainConfig(), _Scaled, rank=0)
    assert deferred is None and torch.equal(model.weight, want)  # whole, as without sharding
    out = capsys.readouterr().out
    assert "lowcomm: note: --worker-sharding fsdp: the model is built whole" in out


def test_a_rank_never_holds_the_whole_model() -> None:
    """A 120 MB GPT made tensor by tensor: the process's peak memory grows by the rows kept
    and a few of its largest tensors (9 MB each), never by the model."""
    script = textwrap.dedent(
        """
        import resource, torch
        from lowcomm.models import ModelConfig, build_model
        from lowcomm.models.deferred import build_deferred
        config = ModelConfig(n_layer=4, n_embd=768, n_head=8, block_size=64)
        torch.manual_seed(0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model, deferred = build_deferred(lambda: build_model(config, 2048))
        total = sum(p.numel() * 4 for p in model.parameters())
        kept = 0
        for name in deferred.tensors:  # a rank keeps about 1/R of each: here 1/4
            rows = deferred.tensors[name].shape[0]
            kept += deferred.rows(name, 0, rows // 4).numel() * 4
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        print(total, kept, grown)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    total, kept, grown = (int(x) for x in done.stdout.split())
    print(total, kept, grown)
    assert total > 100e6 and kept < total / 3
    assert grown < kept + 40e6, (grown, kept, total)


def test_pre_flight_builds_the_model_and_method_for_shapes_without_the_compiler_stack() -> None:
    """Pre-flight's model and method (ShapesOnly): every tensor on meta with the CPU build's
    shapes, and no import of torch._dynamo (its first use costs every command ~3 s; the
    built-in GPT: transformers' Llama imports it on its own)."""
    script = textwrap.dedent("""
        import sys
        import torch
        from lowcomm.config import PlacementConfig, TrainConfig
        from lowcomm.launch.run import check_method_options
        from lowcomm.models import ModelConfig, build_model
        from lowcomm.train.task import CorpusTask

        config = TrainConfig(method="diloco", placement=PlacementConfig(workers=2))
        config.model = ModelConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)
        shapes = CorpusTask().shapes_model(config)
        check_method_options(config)
        assert "torch._dynamo" not in sys.modules, "pre-flight imported the compiler stack"
        whole = build_model(config.model, config.data.vocab_size)
        real = {name: t.shape for name, t in whole.state_dict().items()}
        meta = {name: t.shape for name, t in shapes.state_dict().items()}
        assert real == meta, (real, meta)
        assert all(t.is_meta for t in shapes.state_dict().values())
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
