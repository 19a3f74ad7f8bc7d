"""``kl-adapters doctor``: read a TRL / verl / OpenRLHF configuration the way the framework does and report what its
KL gradient optimizes, its hazards and the one-line fix (issue 14). One reader per framework (`trl`, `verl`,
`openrlhf`), the verdict and output in `report`, launch-script parsing in `shell`; which native setting equals which
preset lives in `kl_adapters.native`, shared with the adapters."""

from __future__ import annotations

import importlib

from .report import EXIT_CODES, SCHEMA, UNREADABLE, DoctorError, Report, format_report

FRAMEWORKS = ("trl", "verl", "openrlhf")

__all__ = ["EXIT_CODES", "FRAMEWORKS", "SCHEMA", "UNREADABLE", "DoctorError", "Report", "diagnose", "format_report"]


def diagnose(framework: str, argv: list[str], **options) -> Report:
    """The doctor's report on `argv` (the framework's arguments, a config file or a launch script; see each reader).

    Raises DoctorError, and only DoctorError, when the configuration cannot be read (the CLI's exit code 2): each
    reader names what it cannot read; any other exception becomes a one-line DoctorError here. What kl-adapters
    refuses is a report with the verdict "refused" (exit 3), never an exception."""
    if framework not in FRAMEWORKS:
        raise DoctorError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    reader = importlib.import_module(f".{framework}", __name__)
    try:
        return reader.read(list(argv), **options)
    except DoctorError as err:  # a framework's own message may span lines
        message = str(err)
    except ImportError as err:  # the framework is installed but a module its parser needs is not
        message = f"{framework}'s configuration code could not be imported: {err}"
    except Exception as err:  # what no reader anticipated: one line for the user, never a traceback
        message = (f"the doctor could not read it ({type(err).__name__}: {err}); please report this command line to "
                   "kl-adapters")
    raise DoctorError(" ".join(message.split()))
