"""The contract every trainable model in lowcomm satisfies.

Strategies and the training loop only ever call ``model(idx, targets)`` and use the ordinary
``nn.Module`` API (parameters, state_dict, train/eval, to), so the contract is an abstract
``nn.Module`` subclass rather than a structural Protocol: that way a ``CausalLM`` keeps every
``nn.Module`` method visible to the type checker.
"""

from __future__ import annotations

import abc

from torch import Tensor, nn


class CausalLM(nn.Module, abc.ABC):
    """A next-token language model: token ids in, logits and mean cross-entropy out.

    ``targets`` are already the next tokens (``targets[:, t]`` is the token that follows
    ``idx[:, t]``), so implementations must not shift them again.
    """

    @abc.abstractmethod
    def forward(
        self, idx: Tensor, targets: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """Run the model.

        Args:
            idx: Token ids, int64 of shape ``(B, T)``.
            targets: Next-token ids of shape ``(B, T)``, or None to skip the loss.

        Returns:
            ``(logits, loss)``: logits of shape ``(B, T, V)`` and the mean cross-entropy over
            all ``B * T`` positions (a scalar), or None when ``targets`` is None. With
            ``targets`` and more than :data:`lowcomm.models.loss.CHUNK_ELEMENTS` logits, the
            loss is computed chunk by chunk and the logits, never materialised whole, are
            None.
        """

    def num_parameters(self) -> int:
        """Count trainable parameters, each shared (tied) tensor once.

        Returns:
            The number of distinct parameter elements.
        """
        # nn.Module.parameters() already de-duplicates shared tensors, so tied
        # embedding / output weights are counted once.
        return sum(parameter.numel() for parameter in self.parameters())
