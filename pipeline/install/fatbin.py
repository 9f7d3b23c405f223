"""Cut the CUDA fat binaries inside shared libraries down to one GPU architecture (the size-limited bundle).

Each fatbin in the ELF section .nv_fatbin is rewritten in place so that it holds only the SASS (ELF) entries for
the target arch (sm_90 and sm_90a both report 90) or, where a fatbin has none, its PTX entries with arch <= target
(the driver JIT-compiles those). Kept entries move up, the fatbin's size field is lowered and the freed tail is
zeroed: the file keeps its length and offsets and each fatbin stays where the host code points (entries are
compressed one by one, so blanking them in place would break them). A fatbin with no code usable on the target
keeps only its smallest entry (a valid fatbin for another arch). cuobjdump -lelf / -xelf read the result, and the
kept cubins are byte-identical.
"""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = 0xBA55ED50


def _nv_fatbin(data: bytearray) -> tuple[int, int] | None:
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    for s in sections:
        if bytes(data[names + s[0]:data.index(b"\0", names + s[0])]) == b".nv_fatbin":
            return s[4], s[5]
    return None


def cut(path: Path, arch: int) -> tuple[int, int]:
    """Cut `path`'s fat binaries to `arch`, in place; (device-code bytes kept, dropped)."""
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF":
        return 0, 0
    section = _nv_fatbin(data)
    if section is None:
        return 0, 0
    p, end = section[0], section[0] + section[1]
    kept = dropped = 0
    while p < end:
        magic, _, header, size = struct.unpack_from("<IHHQ", data, p)
        if magic != MAGIC:
            p += 8
            continue
        entries, q, fend = [], p + header, p + header + size
        while q < fend:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            entries.append((q, kind, entry_header + payload, struct.unpack_from("<I", data, q + 28)[0]))
            q += entry_header + payload
        if q != fend:
            raise ValueError(f"{path}: malformed fat binary at byte {p}")
        sass = any(k == 2 and a == arch for _, k, _, a in entries)
        keep = [e for e in entries if (e[1] == 2 and e[3] == arch) or (not sass and e[1] == 1 and e[3] <= arch)]
        keep = keep or [min(entries, key=lambda e: e[2])]
        body = b"".join(bytes(data[q:q + n]) for q, _, n, _ in keep)
        kept += len(body)
        dropped += size - len(body)
        data[p + header:fend] = body + bytes(size - len(body))
        struct.pack_into("<Q", data, p + 8, len(body))
        p = fend
    path.write_bytes(data)
    return kept, dropped
