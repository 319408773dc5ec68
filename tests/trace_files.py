"""A trace's manifests as tests edit them: each rank's records inline, as trace format 3 kept them,
whatever format wrote them (format 4 keeps them in a log beside the manifest)."""

import json
import os

import xxhash

from ttrace_megatron.stream_writer import CHECKSUM
from ttrace_megatron.trace_store import MANIFEST_FILE, RECORD_LOG, RECORD_LOG_FILE


def read_manifest(rank_dir) -> dict:
    """The manifest of ``rank_dir`` with its records inline under "records" (every line of its log)."""
    m = json.loads(open(os.path.join(rank_dir, MANIFEST_FILE)).read())
    if RECORD_LOG in m:
        with open(os.path.join(rank_dir, RECORD_LOG_FILE)) as f:
            m["records"] = [json.loads(line) for line in f if line.strip()]
        del m[RECORD_LOG]
    return m


def write_manifest(rank_dir, m: dict, *, inline: bool = False) -> None:
    """Write ``m`` (records inline) back: its records into the log, and the log's whole bytes, count
    and digest into the manifest; ``inline``: as format 3 wrote it, the records in the manifest."""
    m = dict(m)
    if not inline:
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in m.pop("records")).encode()
        with open(os.path.join(rank_dir, RECORD_LOG_FILE), "wb") as f:
            f.write(text)
        m[RECORD_LOG] = {"file": RECORD_LOG_FILE, "bytes": len(text), "records": text.count(b"\n"),
                         CHECKSUM: xxhash.xxh3_64_hexdigest(text)}
    with open(os.path.join(rank_dir, MANIFEST_FILE), "w") as f:
        json.dump(m, f)
