"""The `cossd` command line: format, mount and administer an emulated computational SSD.

The verbs live in families, one module each (tools/verbs/*.py); every module has
`register(verb)`, called with build_parser's verb factory. Here: the parser, the entry point,
the nvme-cli compatible entry (run as `nvme`) and the help of the arguments most verbs share.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import importlib
from types import ModuleType

from ..protocol.status import DeviceError
from ..settings import SettingError
from .arguments import NVME_PROG

# Every verb once: its name and its family (the module tools/verbs/FAMILY.py that registers it
# with register(verb)), in the order `cossd --help` lists them: a device's life first (format,
# mount, its namespaces and steps), then the nvme-cli verbs, then the rest.
VERBS: tuple[tuple[str, str], ...] = (
    ("format", "device"), ("mount", "device"), ("serve", "device"), ("umount", "device"),
    ("create-ns", "namespace"), ("delete-ns", "namespace"),
    ("id-ctrl", "admin"), ("begin-step", "admin"), ("commit-step", "admin"), ("abort-step", "admin"),
    ("revert-step", "admin"),
    ("smart-log", "logs"), ("error-log", "logs"), ("server-log", "logs"), ("get-log", "logs"),
    ("id-ns", "namespace"), ("admin-passthru", "admin"), ("flush", "admin"), ("scrub", "admin"),
    ("list", "device"), ("version", "admin"),
    ("demo", "harness"), ("bench", "harness"),
    ("top", "top"),
    ("get-feature", "features"), ("set-feature", "features"),
    ("inject-error", "inject"),
    ("model", "model"),
    ("snapshot", "snapshots"), ("rollback", "snapshots"), ("clone", "snapshots"), ("export", "snapshots"),
    ("archive", "archive"), ("restore", "archive"),
    ("cp-list-programs", "computational"), ("cp-activate", "computational"), ("cp-exec", "computational"),
    ("slm-id-ns", "computational"),
    ("slm-read", "computational"), ("slm-write", "computational"),
)

# Derived from VERBS. The family of each verb: `cossd VERB` imports that family alone and builds
# a parser of that verb alone. The families import what their verbs need (numpy, the clients,
# the server), and `cossd mount` at a restart would otherwise pay for all of it before it starts
# the daemon. tests/cli/test_tools_compat.py checks it against what the families register.
VERB_FAMILIES = dict(VERBS)
# The families, in the order they register (the first verb of each, in the help's order).
FAMILIES = tuple(dict.fromkeys(VERB_FAMILIES.values()))
HELP_ORDER = tuple(VERB_FAMILIES)


def family(name: str) -> ModuleType:
    return importlib.import_module(f".verbs.{name}", __package__)


class _Verbs:
    """build_parser's verb factory (tools/arguments.py, VerbFactory): adds each verb a family
    registers, or, for a parser of one verb (`only`), that verb alone; the others' parsers are
    made and dropped."""

    def __init__(self, verbs: argparse._SubParsersAction, only: str | None) -> None:
        self.verbs = verbs
        self.only = only

    def wants(self, name: str) -> bool:
        return self.only is None or name == self.only

    def __call__(self, name: str, handler: Callable[[argparse.Namespace], int], help_text: str,
                 formats: tuple[str, ...] = ("normal", "json")) -> argparse.ArgumentParser:
        if self.wants(name):
            sub = self.verbs.add_parser(name, help=help_text, description=help_text)
        else:
            sub = argparse.ArgumentParser(add_help=False)
        sub.set_defaults(handler=handler)
        sub.add_argument("-o", "--output-format", choices=formats, default="normal",
                         help="output format (default: normal)")
        return sub


def build_parser(prog: str = "cossd", only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every verb, or with `only` (a verb of VERB_FAMILIES) that
    verb alone, its family's imports alone paid for."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="An emulated computational SSD that runs the Adam optimizer inside the drive.",
        epilog="Run `cossd VERB --help` for a verb's options. Docs: docs/ in the source tree.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    factory = _Verbs(verbs, only)
    for name in FAMILIES if only is None else (VERB_FAMILIES[only],):
        family(name).register(factory)
    if only is None:
        _list_in_help_order(verbs)
    _describe_common_arguments(verbs)
    return parser


def _list_in_help_order(verbs: argparse._SubParsersAction) -> None:
    """Put the verbs in HELP_ORDER: in `--help`, and in the choices an unknown verb is told."""
    if sorted(verbs.choices) != sorted(HELP_ORDER):  # a verb added without a place in the help
        raise RuntimeError(f"HELP_ORDER names {sorted(HELP_ORDER)}, the verb modules register "
                           f"{sorted(verbs.choices)}")
    position = {name: index for index, name in enumerate(HELP_ORDER)}
    parsers = sorted(verbs.choices.items(), key=lambda item: position[item[0]])
    verbs.choices.clear()
    verbs.choices.update(parsers)
    # argparse keeps the help lines in a list of its own, in the order the verbs were added.
    verbs._choices_actions.sort(key=lambda action: position[action.dest])


# What the positionals most verbs share mean, said once for every verb that takes them.
COMMON_ARGUMENT_HELP = {
    "mountpoint": "where the device is mounted (as `cossd mount` was given it)",
    "backing": "the device's backing directory (as `cossd format` was given it)",
    "name": "namespace name",
}


def _describe_common_arguments(verbs: argparse._SubParsersAction) -> None:
    for sub in verbs.choices.values():
        for action in sub._actions:
            if action.help is None and action.dest in COMMON_ARGUMENT_HELP:
                action.help = COMMON_ARGUMENT_HELP[action.dest]


# Run as `nvme` (argv[0], e.g. a symlink to the cossd entry point), cossd answers nvme-cli's
# verbs, so that monitoring scripts written for nvme-cli run against it unchanged.
NVME_VERBS = ("list", "id-ctrl", "id-ns", "smart-log", "error-log", "get-log", "admin-passthru",
              "version", "help")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    if prog is None:  # the name it was run by: `nvme` answers as nvme-cli
        prog = NVME_PROG if argv is None and Path(sys.argv[0]).name == NVME_PROG else "cossd"
    words = list(sys.argv[1:] if argv is None else argv)
    # A known verb gets a parser of its own (its family's imports alone); anything else (no
    # verb, help, an unknown one) the whole command line, to list or suggest every verb.
    only = words[0] if words and words[0] in VERB_FAMILIES else None
    if prog == NVME_PROG and only not in NVME_VERBS:
        only = None
    parser = build_parser(prog, only)
    if not words or words == ["help"]:
        # The bare name prints the usage and succeeds, as nvme-cli does: scripts probe for
        # nvme-cli that way (nvme_metrics.py runs `nvme` and stops on a failure).
        parser.print_help()
        return 0
    if words[0] == "help":  # nvme-cli's `help VERB`
        words = [words[1], "--help"]
    elif words[0] == "--version":
        words[0] = "version"
    if prog == NVME_PROG and not words[0].startswith("-") and words[0] not in NVME_VERBS:
        print(f"{prog}: {words[0]!r} is not a verb cossd answers as nvme-cli "
              f"({', '.join(NVME_VERBS)}); run it as `cossd {words[0]}`", file=sys.stderr)
        return 1
    args = parser.parse_args(words)
    args.prog = prog
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`cossd list | head`): stop quietly, as a C tool killed by
        # SIGPIPE would. Later writes, and the flush at exit, go to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for such a tool
    except DeviceError as exc:
        print(f"{prog} {args.verb}: {exc.message} [{exc.status.name}]", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, SettingError) as exc:  # SettingError: a COSSD_* knob set wrong
        print(f"{prog} {args.verb}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OverflowError) as exc:
        # A value the client refused to send (a field out of its width: client/admin.py,
        # check_field), or one a field could not hold: the one line, never a traceback.
        print(f"{prog} {args.verb}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
