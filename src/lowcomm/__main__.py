"""``python -m lowcomm`` (used by ``torchrun -m lowcomm train ...``)."""

from lowcomm.cli import main

main()
