"""Result files written atomically: a reader sees the old file or the new one, never half."""
import json
import os
from pathlib import Path


def write_json_atomically(path: Path, payload: dict) -> None:
    """Write to a temporary file and rename: a reader never sees half a file. The temporary
    name is this writer's own, so two processes writing the same file never mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
