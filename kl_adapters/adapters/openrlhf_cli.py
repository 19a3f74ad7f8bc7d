"""``python -m kl_adapters.adapters.openrlhf_cli ARGS``: the OpenRLHF launcher's command, which users' scripts, the docs
and the doctor's advice name; the launcher itself is `kl_adapters.adapters.openrlhf.cli` (its `main`)."""

from .openrlhf.cli import main

if __name__ == "__main__":
    main()
