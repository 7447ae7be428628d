"""A writer for the kill test: uploads one large object and says ``PART`` on its first
stored part; the test SIGKILLs it there. For a folder, the writer then stalls inside
the write (a slow disk's stand-in) so the kill finds it mid-file.

argv: URL KEY MIB MODE (``s3`` or ``folder``)."""

from __future__ import annotations

import sys
import time

from async_stager._store.objects import TransferOptions
from async_stager._store.store import open_store


def main() -> None:
    url, key, mib, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    store = open_store(url, TransferOptions(part_size=5 << 20, concurrency=2))
    said: list[int] = []

    def progress(_n: int) -> None:
        if not said:
            said.append(1)
            print("PART", flush=True)
            if mode == "folder":
                time.sleep(600)

    store.blocking.put(key, bytes(mib << 20), progress=progress)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
