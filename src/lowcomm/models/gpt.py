"""A small single-device GPT (decoder-only transformer) in the style of nanoGPT.

No distributed code lives here: strategies wrap or shard the model from the outside.

Dropout draws its masks from a generator the training loop binds for each micro-batch (the
worker's own random stream, :func:`drawing_from`), never from the process-global generator
that several workers of one process would share; unbound (a model used on its own), it draws
from the global one as ``nn.Dropout`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as functional
from torch import Tensor, nn

from lowcomm.models.base import CausalLM
from lowcomm.models.loss import chunked_cross_entropy, fits_one_chunk, next_token_loss


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    n_layer: int = 4
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 256
    """Width of the residual stream (embedding size)."""

    block_size: int = 128
    """Longest sequence the model accepts (size of the learned position table)."""

    vocab_size: int = 2048
    """Number of token ids."""

    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""

    bias: bool = False
    """Whether linear layers and LayerNorms carry a bias."""

    def __post_init__(self) -> None:
        check_shape(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            block_size=self.block_size,
            dropout=self.dropout,
            vocab_size=self.vocab_size,
        )


def check_shape(*, dropout: float, **sizes: int) -> None:
    """Validate a transformer's shape; errors name the command-line flag and the fix.

    Raises:
        ValueError: for a non-positive size, a width not divisible by the head count, or a
            dropout outside [0, 1).
    """
    for field_name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"--model.{field_name.replace('_', '-')}: {value!r} is not a positive integer; "
                f"pass an integer >= 1"
            )
    n_head, n_embd = sizes["n_head"], sizes["n_embd"]
    if n_embd % n_head != 0:
        raise ValueError(
            f"--model.n-embd: {n_embd} is not divisible by --model.n-head={n_head}; each head "
            f"gets n_embd / n_head channels, so pick n_embd as a multiple of n_head (for "
            f"example {n_head * max(1, round(n_embd / n_head))})"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(
            f"--model.dropout: {dropout} is outside [0, 1); pass a probability such as 0.0"
        )


class Dropout(nn.Module):
    """``nn.Dropout`` whose mask comes from ``generator`` when one is bound (else from the
    process-global generator). The mask is drawn as ATen's CPU dropout draws it (a Bernoulli
    tensor of the input's shape, scaled by ``1 / (1 - p)``), on the input's device, so
    ``generator`` must be a generator of that device.

    Args:
        p: the probability of zeroing an element.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.generator: torch.Generator | None = None

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.generator)
        return x * keep.div_(1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


@contextmanager
def drawing_from(dropouts: list[Dropout], generator: torch.Generator | None) -> Iterator[None]:
    """Bind ``generator`` to ``dropouts`` (a model's :class:`Dropout` modules, see
    :func:`dropout_modules`) for the duration, then unbind it: only what runs inside (the
    training loop's micro-batch) draws from it."""
    for dropout in dropouts:
        dropout.generator = generator
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.generator = None


def dropout_modules(model: nn.Module) -> list[Dropout]:
    """``model``'s :class:`Dropout` modules that can drop (p > 0)."""
    return [module for module in model.modules() if isinstance(module, Dropout) and module.p > 0]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through PyTorch's fused SDPA kernel; with dropout in
    training, an explicit attention whose dropout draws from the bound generator (SDPA's
    internal dropout takes no generator)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # One projection for query, key and value: a single larger matmul is faster.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attention_dropout = Dropout(config.dropout)
        self.residual_dropout = Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape  # (B, T, C)
        head_size = channels // self.n_head
        query, key, value = self.qkv(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        query = query.view(batch, time, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        key = key.view(batch, time, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        value = value.view(batch, time, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        if self.training and self.dropout > 0:
            attended = self._attend_with_dropout(query, key, value)  # (B, nh, T, hs)
        else:
            attended = functional.scaled_dot_product_attention(
                query, key, value, is_causal=True
            )  # (B, nh, T, hs)
        attended = attended.transpose(1, 2).contiguous().view(batch, time, channels)  # (B, T, C)
        output: Tensor = self.residual_dropout(self.proj(attended))  # (B, T, C)
        return output

    def _attend_with_dropout(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """SDPA's math, with the attention weights dropped by :attr:`attention_dropout`."""
        time = query.size(-2)
        scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))  # (B, nh, T, T)
        future = torch.ones(time, time, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        # The softmax in float32 even under autocast, as SDPA's math path computes it.
        weights = functional.softmax(scores.float(), dim=-1).to(value.dtype)  # (B, nh, T, T)
        dropped: Tensor = self.attention_dropout(weights)
        return dropped @ value  # (B, nh, T, hs)


class MLP(nn.Module):
    """Position-wise feed-forward block: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.expand = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.activation = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.activation(self.expand(x))  # (B, T, 4C)
        output: Tensor = self.dropout(self.proj(hidden))  # (B, T, C)
        return output


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))  # (B, T, C)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, C)
        return x


class GPT(CausalLM):
    """GPT-2 style decoder: learned positions, pre-LN blocks, tied input/output embedding.

    Args:
        config: The model shape; see :class:`GPTConfig`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.embedding_dropout = Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one matrix maps ids to vectors and vectors back to logits, which saves
        # vocab_size * n_embd parameters and helps small models.
        self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # GPT-2: residual-branch output projections are scaled down so the residual stream's
        # variance does not grow with depth (two residual additions per block).
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attention.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Compute next-token logits and, given targets, the mean cross-entropy.

        Args:
            idx: Token ids, int64 of shape ``(B, T)`` with ``T <= block_size``.
            targets: Next-token ids of shape ``(B, T)``, or None.

        Returns:
            ``(logits, loss)``: logits ``(B, T, V)``; loss is a scalar or None.

        Raises:
            ValueError: If the sequence is longer than ``block_size``.
        """
        _, time = idx.shape  # (B, T)
        if time > self.config.block_size:
            raise ValueError(
                f"sequence length {time} exceeds model.block_size={self.config.block_size}; "
                f"raise model.block_size or feed shorter sequences"
            )
        positions = torch.arange(time, dtype=torch.long, device=idx.device)  # (T,)
        x = self.token_embedding(idx) + self.position_embedding(positions)  # (B, T, C)
        x = self.embedding_dropout(x)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.final_norm(x)
        if targets is not None and not fits_one_chunk(
            x.size(0) * x.size(1), self.config.vocab_size
        ):
            # A large vocabulary: the loss chunk by chunk, the (B, T, V) logits never whole.
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets)
        logits: Tensor = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        # Cross-entropy in float32 even under autocast: the log-sum-exp over the vocabulary
        # is where low precision hurts.
        return logits, next_token_loss(logits, targets)
