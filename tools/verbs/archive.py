"""CLI verbs of the archive tier: archive (a snapshot to an object store, by the device;
--list the versions there) and restore (a namespace built from one, offline, like format).

`archive` is a client of the mount (cossd.client.archive). `archive --list` without a device
and `restore` read the store from this node: they import the device's archive module
(cossd.emulator.archive: versions.py, restore.py), as the device verbs import the device (an import-linter entry).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..arguments import VerbFactory, add_device_argument, parse_positive, parse_size
from ..output import emit, human_bytes, open_client




class _Progress:
    """One status line on stderr, rewritten at most 5 times a second (none with -q)."""

    def __init__(self, what: str, quiet: bool) -> None:
        self.what, self.quiet = what, quiet
        self.started = self.shown = time.monotonic()

    def __call__(self, done: int, total: int, final: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not final and now - self.shown < 0.2):
            return
        self.shown = now
        rate = done / max(now - self.started, 1e-9)
        print(f"\r{self.what}: {human_bytes(done)} / {human_bytes(total)} ({100 * done / max(total, 1):.0f}%, "
              f"{human_bytes(rate)}/s)", end="\n" if final else "", file=sys.stderr, flush=True)


def _list_versions(args: argparse.Namespace) -> int:
    if args.name is not None or args.tag is not None:
        raise SystemExit("cossd archive: --list takes no NAMESPACE or TAG (the mountpoint, if "
                         "given, is the device that lists the store)")
    if args.mountpoint is not None:
        from ...client.archive import archived_versions

        with open_client(args) as client:
            listing = archived_versions(client, args.list, endpoint_url=args.endpoint_url)
        for entry in listing.get("unreadable", []):  # left out of the listing, said on stderr
            print(f"cossd archive: left out: {entry['error']}", file=sys.stderr)
    else:
        from ...emulator.archive import versions as archive

        root = archive.parse_url(args.list)
        unreadable: list[dict[str, str]] = []
        store = archive.Store(args.endpoint_url, holder="this process (cossd archive --list)")
        listing = {"url": root.url, "versions": archive.list_versions(store, root, unreadable)}
        for entry in unreadable:  # left out of the listing, said on stderr
            print(f"cossd archive: left out: {entry['error']}", file=sys.stderr)

    def table(value: dict[str, Any]) -> str:
        lines = [f"{'namespace':<20} {'tag':<24} {'step':>8} {'bytes':>10}  {'archived':<20}  where"]
        for v in value["versions"]:
            lines.append(f"{v['namespace']:<20} {v['tag']:<24} {v['step']:>8} {human_bytes(v['bytes']):>10}  "
                         f"{v['archived']:<20}  {v['url']} ({v['endpoint']})"
                         + ("" if v.get("manifest_checked", True) else "  [format-1 manifest: no checksum]"))
        return "\n".join(lines) if value["versions"] else f"no complete versions under {value['url']}"

    emit(args, listing, table)
    return 0


def _policy(args: argparse.Namespace) -> int:
    """--every K (on) or --off: the device's own archiving of one namespace; --status: what
    every policy did."""
    from ...client.archive import archive_statistics, set_archive_policy

    if args.mountpoint is None or (args.name is None and not args.status) or args.tag is not None:
        raise SystemExit("cossd archive: give MOUNTPOINT NAMESPACE --every K --to s3://BUCKET/PREFIX "
                         "(or --off; or MOUNTPOINT [NAMESPACE] --status): no TAG, the device names its "
                         "versions auto-STEP")
    with open_client(args) as client:
        if args.status:
            page = archive_statistics(client, client.nsid(args.name) if args.name else 0xFFFFFFFF)
            value = page.get("policies", {})
            if page.get("policy_file_error"):
                print(f"cossd archive: {page['policy_file_error']}", file=sys.stderr)

            def table(value: dict[str, Any]) -> str:
                if not value:
                    return "no automatic archive policy"
                lines = []
                for name, view in value.items():
                    policy, state = view["policy"], view["state"]
                    head = (f"{name}: every {policy['every']} steps to {policy['url']}, keep {policy['keep_local']} "
                            f"on the drive and {policy['keep_remote']} in the store" if policy else f"{name}: off")
                    lines.append(head)
                    lines.append(f"  archived {state['versions_archived']} (last step {state['last_archived_step']}), "
                                 f"uploading {state['uploading'] or '-'}, waiting {len(state['pending'])}, "
                                 f"coalesced {state['coalesced']}, failures {state['upload_failures']}"
                                 + (f" (last: {state['last_error']})" if state["last_error"] else ""))
                return "\n".join(lines)

            emit(args, value, table)
            return 0
        policy = None
        if not args.off:
            if args.to is None:
                raise SystemExit("cossd archive: --every needs --to s3://BUCKET/PREFIX")
            policy = {"url": args.to, "every": args.every}
            for key, value in (("keep_local", args.keep_local), ("keep_remote", args.keep_remote),
                               ("max_pending", args.max_pending), ("spill_capacity", args.spill_capacity),
                               ("endpoint_url", args.endpoint_url),
                               ("chunk_bytes", args.chunk_size), ("memory_bytes", args.archive_memory)):
                if value is not None:
                    policy[key] = value
        result = set_archive_policy(client, client.nsid(args.name), policy)

    def normal(value: dict[str, Any]) -> str:
        on = value["policy"]
        if on is None:
            return f"automatic archive of {value['namespace']!r}: off"
        return (f"automatic archive of {value['namespace']!r}: a snapshot every {on['every']} committed steps "
                f"(auto-STEP), uploaded by the device to {on['url']}; keeping {on['keep_local']} on the drive, "
                f"{on['keep_remote']} in the store, at most {on['max_pending']} waiting for it"
                + (f" in at most {on['spill_capacity']} bytes of the drive" if on.get("spill_capacity") else ""))

    emit(args, result, normal)
    return 0


def cmd_archive(args: argparse.Namespace) -> int:
    if args.list is not None:
        return _list_versions(args)
    if args.every is not None or args.off or args.status:
        return _policy(args)
    if args.mountpoint is None or args.name is None or args.tag is None or args.to is None:
        raise SystemExit("cossd archive: give MOUNTPOINT NAMESPACE TAG --to s3://BUCKET/PREFIX "
                         "(or --list s3://BUCKET/PREFIX)")
    from ...client.archive import archive, wait_for_archive

    with open_client(args) as client:
        job = archive(client, client.nsid(args.name), args.tag, args.to,
                      endpoint_url=args.endpoint_url, chunk_bytes=args.chunk_size,
                      memory_bytes=args.archive_memory, overwrite=args.force)
        if args.wait:
            bar = _Progress(f"archive {args.name}/{args.tag}", args.quiet)
            job = wait_for_archive(client, job, lambda j: bar(j["bytes_done"], j["bytes_total"]))
            bar(job["bytes_done"], job["bytes_total"], final=True)

    def normal(value: dict[str, Any]) -> str:
        if value["state"] == "running":
            return (f"archive job {value['job']} started: snapshot {value['tag']!r} of "
                    f"{value['namespace']!r} (step {value['step']}) to {value['path']}; "
                    "progress: log page 0xc2")
        seconds = max((value["finished"] or 0) - value["started"], 1e-9)
        return (f"archived snapshot {value['tag']!r} of {value['namespace']!r} (step {value['step']}) "
                f"to {value['path']} ({human_bytes(value['bytes_total'])}, {human_bytes(value['bytes_total'] / seconds)}/s)")

    emit(args, job, normal)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from ...emulator.archive import restore as archive_restore, versions as archive

    bar = _Progress(f"restore {args.url}", args.quiet)
    result = archive_restore.restore(args.url, args.backing, name=args.name, endpoint_url=args.endpoint_url,
                                     memory_bytes=args.archive_memory or archive.DEFAULT_MEMORY_BYTES,
                                     sync=args.sync, progress=bar, capacity_bytes=args.capacity,
                                     accept_unchecked=args.accept_unchecked_manifest)
    bar(result["bytes"], result["bytes"], final=True)
    emit(args, result, lambda r: f"restored {r['source']} into namespace {r['namespace']!r} "
         f"(nsid {r['nsid']}, step {r['step']}) of {r['backing']}"
         f"{' (formatted)' if r['formatted'] else ''}: {human_bytes(r['bytes'])} in {r['seconds']:.1f} s")
    return 0


def register(verb: VerbFactory) -> None:
    sub = verb("archive", cmd_archive,
               "Have the device upload a snapshot to an S3-compatible object store in the "
               "background (a manifest written last makes the version complete); --list the "
               "complete versions under a location.")
    add_device_argument(sub, nargs="?")  # MOUNTPOINT|cossd://HOST:PORT, --token-file, --ca
    sub.add_argument("name", nargs="?", help="namespace")
    sub.add_argument("tag", nargs="?", help="snapshot to archive")
    sub.add_argument("--to", metavar="s3://BUCKET/PREFIX",
                     help="where: the version goes to s3://BUCKET/PREFIX/NAMESPACE/TAG/")
    sub.add_argument("--list", metavar="s3://BUCKET/PREFIX",
                     help="list the complete versions there (through the device when MOUNTPOINT "
                          "is given, else from this node)")
    sub.add_argument("--endpoint-url", help="the store's endpoint (default: as boto3 finds it, "
                                            "e.g. $AWS_ENDPOINT_URL)")
    sub.add_argument("--chunk-size", type=parse_size, help="bytes per chunk and multipart part "
                                                           "(default 8M, at least 5M)")
    sub.add_argument("--archive-memory", type=parse_size,
                     help="the most chunk bytes the device holds at once (default 64M)")
    sub.add_argument("--force", action="store_true", help="replace a version archived already (the old one stays whole until the new one is complete)")
    sub.add_argument("--wait", action="store_true", help="wait for the upload, with its progress")
    sub.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    policy = sub.add_argument_group(
        "automatic archiving (no TAG)",
        "the device snapshots the namespace every K committed steps (tags auto-STEP) and uploads "
        "each snapshot itself, one at a time; while the store is slower than versions come, they "
        "wait on the drive, and beyond --max-pending (or --spill-capacity) the older waiting ones are dropped "
        "(coalesced, counted); kept across restarts (docs/tiers.md)")
    policy.add_argument("--every", type=parse_positive, metavar="K", help="a version every K committed steps")
    policy.add_argument("--keep-local", type=parse_positive, metavar="N", help="the policy's snapshots kept on the drive (default 2)")
    policy.add_argument("--keep-remote", type=parse_positive, metavar="M", help="its versions kept in the store (default 3)")
    policy.add_argument("--max-pending", type=parse_positive, metavar="P",
                        help="versions waiting for the store at most (default and most: --keep-local)")
    policy.add_argument("--spill-capacity", type=parse_size, metavar="BYTES",
                        help="the drive's bytes that versions waiting for the store may take (each a snapshot "
                             "of the namespace's state; default: no bound but --max-pending)")
    policy.add_argument("--off", action="store_true", help="stop the namespace's automatic archiving")
    policy.add_argument("--status", action="store_true", help="each policy and what it did (log page C4h)")

    sub = verb("restore", cmd_restore,
               "Build a namespace from an archived version (disaster recovery), offline: in the "
               "device at BACKING, formatted first where there is none; every chunk and block "
               "checksum verified, nothing built if one fails.")
    sub.add_argument("url", metavar="s3://BUCKET/PREFIX/NAMESPACE/TAG", help="the version")
    sub.add_argument("backing", type=Path)
    sub.add_argument("--name", help="the new namespace's name (default: the archived one's)")
    sub.add_argument("--endpoint-url", help="the store's endpoint (default: as boto3 finds it)")
    sub.add_argument("--archive-memory", type=parse_size,
                     help="the most chunk bytes held at once (default 64M)")
    sub.add_argument("--sync", action="store_true", help="open the device as `mount --sync` would")
    sub.add_argument("--capacity", type=parse_size,
                     help="a fresh device's capacity, e.g. 64G, as `cossd format --capacity` (default: the "
                          "filesystem's free space); refused where BACKING holds a device")
    sub.add_argument("--accept-unchecked-manifest", action="store_true",
                     help="restore a version whose manifest is format 1, which has no checksum of its own "
                          "(its chunks and blocks are verified all the same)")
    sub.add_argument("-q", "--quiet", action="store_true", help="no progress line")
