"""Live membership: workers that die and join while the others keep training, decided by an
existing engine (torchft) rather than a coordinator of lowcomm's (docs/membership.md).

* :mod:`lowcomm.membership.options`: ``--membership`` and ``--membership.*``, and the refusals;
* :mod:`lowcomm.membership.torchft_comm`: a ``Comm`` over torchft's Manager and reconfigurable
  Gloo group, and the runtime's ``Membership`` that opens each round with a quorum;
* :mod:`lowcomm.membership.worker`: one worker's training (a torchft replica group);
* :mod:`lowcomm.membership.local`: a local job: a lighthouse on 127.0.0.1 and the worker
  processes, which it can kill and start again.

Only this package imports torchft, and only when a run asks for it.
"""

from lowcomm.membership.options import MembershipOptions, membership_refusal

__all__ = ["MembershipOptions", "membership_refusal"]
