"""CLI verbs for snapshots, rollback, clone and export (CBh-CFh, C1h, C2h); the calls
themselves are cossd.client.snapshots."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ...client import AdminClient
from ...client.snapshots import (
    clone,
    create_snapshot,
    delete_snapshot,
    export,
    raise_if_failed,
    rollback,
    snapshots,
    wait_for_job,
)
from ...protocol.entries import NSID_ALL
from ..arguments import VerbFactory, add_device_argument
from ..output import emit, human_bytes, open_client




def cmd_snapshot(args: argparse.Namespace) -> int:

    if args.list:
        if args.tag is not None:
            raise SystemExit("cossd snapshot: --list takes no TAG")
        with open_client(args) as client:
            nsid = client.nsid(args.name) if args.name else NSID_ALL
            listing = snapshots(client, nsid)

        def table(value: dict[str, list[dict[str, Any]]]) -> str:
            lines = [f"{'namespace':<20} {'tag':<24} {'step':>8} {'bytes':>10}  created"]
            for namespace, entries in value.items():
                for entry in entries:
                    if entry["state"] == "ready":
                        lines.append(f"{namespace:<20} {entry['tag']:<24} {entry['step']:>8} "
                                     f"{human_bytes(entry['bytes']):>10}  {entry['created']}")
                    else:
                        lines.append(f"{namespace:<20} {entry['tag']:<24} {'-':>8} "
                                     f"{human_bytes(entry['bytes']):>10}  DAMAGED: {entry['error']}")
            return "\n".join(lines) if len(lines) > 1 else "no snapshots"

        emit(args, listing, table)
        return 0
    if args.name is None:
        raise SystemExit("cossd snapshot: give NAMESPACE and TAG (or --list, or --delete TAG)")
    if args.delete is not None:
        if args.tag is not None:
            raise SystemExit("cossd snapshot: give the tag to delete once, after --delete")
        with open_client(args) as client:
            value = delete_snapshot(client, client.nsid(args.name), args.delete)
        emit(args, value, lambda v: f"deleted snapshot {v['deleted']!r} of namespace {v['namespace']!r}")
        return 0
    if args.tag is None:
        raise SystemExit("cossd snapshot: give TAG to create a snapshot (or --list, or --delete TAG)")
    with open_client(args) as client:
        value = create_snapshot(client, client.nsid(args.name), args.tag)
    emit(args, value, lambda v: f"snapshot {v['tag']!r} of namespace {v['namespace']!r} at step "
                                f"{v['step']} ({human_bytes(v['bytes'])})")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:

    with open_client(args) as client:
        value = rollback(client, client.nsid(args.name), args.tag)
    emit(args, value, lambda v: f"namespace {v['namespace']!r} rolled back to snapshot {v['tag']!r}: "
                                f"step {v['step']} (was {v['previous_step']})")
    return 0


def cmd_clone(args: argparse.Namespace) -> int:

    with open_client(args) as client:
        value = clone(client, client.nsid(args.name), args.tag, args.new_name)
    emit(args, value, lambda v: f"cloned snapshot {v['tag']!r} of namespace {v['source']!r} into "
                                f"namespace {v['name']!r} (nsid {v['nsid']}, step {v['committed_step']})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:

    path = os.path.abspath(args.path) if args.path else None  # the daemon has its own cwd
    with open_client(args) as client:
        nsid = client.nsid(args.name)
        job = export(client, nsid, tag=args.tag, path=path, optimizer_state=args.with_state,
                     overwrite=args.force)
        if not args.no_wait:
            job = _wait_with_bar(client, job, quiet=args.quiet)
        tensors = client.namespace_config(args.name)["tensors"]
    raise_if_failed(job)
    # A namespace created without shapes exports flat tensors: say so, since a model's
    # load_state_dict would refuse them (the daemon's log says it too).
    flat = [t["name"] for t in tensors if t.get("shape") is None]
    if flat:
        which = "its tensors have" if len(flat) == len(tensors) else f"{len(flat)} of its {len(tensors)} tensors have"
        job = job | {"note": f"namespace {args.name!r}: {which} no recorded shape (created by an older "
                             "cossd, or by create-ns --tensor NAME:NUMEL), so they are exported flat "
                             "(1-D): reshape them to the model's shapes before load_state_dict"}
        if not args.quiet:  # -q keeps stderr for errors; the JSON form carries the note either way
            print(f"cossd export: note: {job['note']}", file=sys.stderr)

    def normal(value: dict[str, Any]) -> str:
        source = f"snapshot {value['tag']!r}" if value["tag"] else "namespace"
        if value["state"] == "running":
            return (f"export job {value['job']} started: {source} of {value['namespace']!r} "
                    f"(step {value['step']}) to {value['path']}; progress: log page 0xc2")
        return (f"exported {source} of {value['namespace']!r} (step {value['step']}) to "
                f"{value['path']} ({human_bytes(value['bytes_total'])})")

    emit(args, job, normal)
    return 0


def _wait_with_bar(client: AdminClient, job: dict[str, Any], quiet: bool) -> dict[str, Any]:
    from tqdm import tqdm

    with tqdm(total=job["bytes_total"], unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"export {job['namespace']}", file=sys.stderr, disable=quiet,
              mininterval=0.2) as bar:
        def progress(current: dict[str, Any]) -> None:
            bar.update(current["bytes_done"] - bar.n)

        return wait_for_job(client, job, progress)


def register(verb: VerbFactory) -> None:
    sub = verb("snapshot", cmd_snapshot,
               "Snapshot a namespace's committed step under a tag; --list the snapshots, "
               "--delete one.")
    add_device_argument(sub)
    sub.add_argument("name", nargs="?", help="namespace (with --list: default every namespace)")
    sub.add_argument("tag", nargs="?", help="tag of the new snapshot")
    sub.add_argument("--list", action="store_true", help="list snapshots (log page 0xc1)")
    sub.add_argument("--delete", metavar="TAG", help="delete the snapshot TAG")

    sub = verb("rollback", cmd_rollback, "Make a snapshot's state the namespace's committed step "
               "(no step may be open).")
    add_device_argument(sub)
    sub.add_argument("name", help="namespace")
    sub.add_argument("tag", help="snapshot to roll back to")

    sub = verb("clone", cmd_clone, "Create a new namespace from a snapshot; it trains on its own.")
    add_device_argument(sub)
    sub.add_argument("name", help="source namespace")
    sub.add_argument("tag", help="snapshot of it")
    sub.add_argument("new_name", help="name of the new namespace")

    sub = verb("export", cmd_export, "Export a namespace (or one of its snapshots) to a "
               "safetensors file, written by the device; waits with a progress bar.")
    add_device_argument(sub)
    sub.add_argument("name", help="namespace")
    sub.add_argument("--tag", help="export this snapshot instead of the committed step")
    sub.add_argument("--path", help="output file (default: BACKING/exports/NS/step-N.safetensors, "
                                    "or BACKING/exports/NS/snapshot-TAG.safetensors with --tag)")
    sub.add_argument("--with-state", action="store_true",
                     help="also export master weights and both moments (<tensor>.master, "
                          "<tensor>.exp_avg, <tensor>.exp_avg_sq)")
    sub.add_argument("--force", action="store_true",
                     help="replace the output file if it exists (without it an existing export is "
                          "never replaced)")
    sub.add_argument("--no-wait", action="store_true", help="return once the job has started")
    sub.add_argument("-q", "--quiet", action="store_true",
                     help="no progress bar, and no note on stderr (-o json carries the note as 'note')")
