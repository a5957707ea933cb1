"""One process of `test_file_backend.py`'s shared-directory test: a file backend over a
directory other processes use at once, under a size bound, making random backups, reads,
lookups and restarts. Every page's bytes follow from its key, so every read it counts is
checked; it prints how many pages it read and found right, and exits 1 on a wrong one.

Usage: python _storage_worker.py DIR SEED OPS MAX_BYTES
"""

from __future__ import annotations

import random
import sys
import zlib

import torch
from hicache.actors import FileBackend, KVBuffer, KVShape
from hicache.runtime import Config, HostLayout

PAGE = 8
HOST_PAGES = 32
KEYS = 200


def main() -> int:
    root, seed, ops, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    layout = rng.choice([HostLayout.PAGE_FIRST, HostLayout.LAYER_FIRST])
    config = Config(layers=2, kv_heads=1, head_dim=32, page_size=PAGE, device_slots=8 * PAGE,
                    host_slots=HOST_PAGES * PAGE, storage="file", storage_dir=root, storage_max_bytes=max_bytes)
    host = KVBuffer.allocate(KVShape.of(config), HOST_PAGES * PAGE, layout, "cpu")
    one_page = host.read(torch.arange(PAGE)).shape

    def slots(pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()

    def page_of(key: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        return torch.randint(-1000, 1000, one_page, generator=g).to(host.tensor.dtype)

    backend, read, right = FileBackend(config), 0, 0
    for _ in range(ops):
        first, n = rng.randrange(KEYS), rng.randint(1, 24)
        keys = [f"page-{(first + i) % KEYS}" for i in range(n)]
        pages = rng.sample(range(HOST_PAGES), n)
        op = rng.random()
        if op < 0.4:
            for key, page in zip(keys, pages):
                host.write(slots([page]), page_of(key))
            backend.write(keys, host, slots(pages))
        elif op < 0.9:
            host.tensor.zero_()
            got = backend.read(keys, host, slots(pages))
            read += got.pages
            right += sum(torch.equal(host.read(slots([pages[i]])), page_of(keys[i])) for i in range(got.pages))
        elif op < 0.97:
            backend.exists(keys)
        else:
            backend.check_invariants()
            backend.close()
            backend = FileBackend(config)
    backend.check_invariants()
    backend.close()
    print(read, right)
    return 0 if read == right else 1


if __name__ == "__main__":
    sys.exit(main())
