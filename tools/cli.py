"""The `cossd` command line: format, mount and administer an emulated computational SSD.

The verbs live in families, one module each (tools/verbs_*.py); every module has
`register(verb)`, called with build_parser's verb factory. Here: the parser, the entry point,
the nvme-cli compatible entry (run as `nvme`) and the help of the arguments most verbs share.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from ..protocol.status import DeviceError
from . import (
    verbs_admin,
    verbs_archive,
    verbs_device,
    verbs_features,
    verbs_harness,
    verbs_inject,
    verbs_logs,
    verbs_model,
    verbs_namespace,
    verbs_snapshots,
    verbs_top,
)
from .nvme_json import NVME_PROG

# The verb families; each registers its verbs with register(verb).
VERB_MODULES = (verbs_device, verbs_namespace, verbs_admin, verbs_logs, verbs_harness, verbs_top,
                verbs_features, verbs_inject, verbs_model, verbs_snapshots, verbs_archive)

# The order `cossd --help` lists the verbs in: a device's life first (format, mount, its
# namespaces and steps), then the nvme-cli verbs, then the rest. Every verb is named here once.
HELP_ORDER = ("format", "mount", "serve", "umount", "create-ns", "delete-ns", "id-ctrl", "begin-step", "commit-step",
              "abort-step", "revert-step", "smart-log", "error-log", "server-log", "get-log", "id-ns", "admin-passthru", "flush",
              "scrub", "list", "version", "demo", "bench", "top", "get-feature", "set-feature", "inject-error", "model",
              "snapshot", "rollback", "clone", "export", "archive", "restore")


def build_parser(prog: str = "cossd") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="An emulated computational SSD that runs the Adam optimizer inside the drive.",
        epilog="Run `cossd VERB --help` for a verb's options. Docs: docs/ in the source tree.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, handler: Callable[[argparse.Namespace], int], help_text: str,
             formats: tuple[str, ...] = ("normal", "json")) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        sub.add_argument("-o", "--output-format", choices=formats, default="normal",
                         help="output format (default: normal)")
        return sub

    for module in VERB_MODULES:
        module.register(verb)
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
    parser = build_parser(prog)
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
    except (OSError, RuntimeError) as exc:
        print(f"{prog} {args.verb}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
