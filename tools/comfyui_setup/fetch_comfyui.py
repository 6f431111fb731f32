"""Install the stock ComfyUI 0.33.0 that `./dev` runs the tests and the demo in, and check it is the real one.

    python -m tools.comfyui_setup.fetch_comfyui SOURCE DEST --manifest tools/comfyui_setup/comfyui-0.33.0.sha256 \
        [--keep FILE]
    python -m tools.comfyui_setup.fetch_comfyui --record TARBALL    # print a manifest of a tarball (maintainers)

SOURCE is a release tarball: a local path, or an http://, https:// or file:// URL (downloaded first). Its one top
folder is stripped, every file listed in the manifest must be there with that SHA-256 (files the manifest does not
list are accepted: the manifest was recorded from ../shared's copy, which lacks two tokenizer files over 4 MB of the
upstream tree), then the tree is moved to DEST in one rename. On any failure nothing is left at DEST or beside it
(DEST.partial, the download) and one `error:` line says what failed and what to do, exit 2. With --keep a
downloaded tarball is kept at FILE once it verified (a later setup, and the tests of this module, reuse it).

Standard library only: `./dev` runs it with the system python, before the project's venv exists."""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request

URL_ENV = "TILED_ATTENTION_COMFYUI_URL"
SHARED_ENV = "TILED_ATTENTION_SHARED"
SCHEMES = ("http", "https", "file")
SHOWN = 5  # problems named in the error line; the count says how many more


class FetchError(Exception):
    """A failure to report as one `error:` line."""


def is_url(source: str) -> bool:
    return "://" in source


def read_manifest(path: str) -> dict[str, str]:
    """{relative path: sha256 hex} from `HASH  PATH` lines (sha256sum's format); `#` lines are comments."""
    entries = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            digest, sep, name = line.partition("  ")
            if not sep or len(digest) != 64:
                raise FetchError(f"{path}:{number}: not a `SHA256  PATH` line: {line!r}")
            entries[name] = digest
    return entries


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(url: str, target: str) -> None:
    """URL (http, https or file) -> target, written in full or not at all."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise FetchError(f"{URL_ENV}={url}: only http://, https:// and file:// URLs are accepted")
    partial = target + ".partial"
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except urllib.error.HTTPError as e:  # the server answered: the address is wrong, not the network
        _remove(partial)
        raise FetchError(f"could not download {url}: the server answered HTTP {e.code} {e.reason}. Check the URL, or "
                         f"set {URL_ENV} to another copy of ComfyUI-0.33.0.tar.gz (a file:// URL works), or "
                         f"{SHARED_ENV} to a folder holding comfyui/ComfyUI-0.33.0.tar.gz") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        _remove(partial)
        reason = getattr(e, "reason", None) or e
        raise FetchError(f"could not download {url}: {reason}. Without network access, set {SHARED_ENV} to a folder "
                         f"holding comfyui/ComfyUI-0.33.0.tar.gz, or {URL_ENV} to a copy of it (a file:// URL "
                         f"works)") from None
    os.replace(partial, target)


def _members(tar: tarfile.TarFile, source: str):
    """(member, path below the tarball's one top folder) for every directory and regular file; anything that could
    write outside the destination (absolute paths, `..`, links) is refused."""
    top = None
    for m in tar.getmembers():
        parts = m.name.strip("/").split("/")
        if m.name.startswith("/") or ".." in parts:
            raise FetchError(f"{source}: member {m.name!r} points outside the tarball's folder; refusing to unpack it")
        if top is None:
            top = parts[0]
        if parts[0] != top:
            raise FetchError(f"{source}: not a release tarball (more than one top folder: {top!r}, {parts[0]!r})")
        if m.issym() or m.islnk():
            raise FetchError(f"{source}: member {m.name!r} is a link; a ComfyUI release tarball has none")
        if m.isdir() or m.isfile():
            yield m, "/".join(parts[1:])


def unpack(tarball: str, dest: str, source: str) -> None:
    """The tarball's files, without its top folder, into dest (which must not exist); `source`: the path or URL
    the tarball came from, which the error names (a file to delete, a URL to check)."""
    try:
        with tarfile.open(tarball) as tar:
            os.makedirs(dest)
            for m, rel in _members(tar, source):
                if not rel:
                    continue
                target = os.path.join(dest, *rel.split("/"))
                if m.isdir():
                    os.makedirs(target, exist_ok=True)
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.chmod(target, 0o755 if m.mode & 0o111 else 0o644)
    except (tarfile.TarError, EOFError, OSError) as e:
        if is_url(source):
            raise FetchError(f"what {source} sent is not a readable .tar.gz ({e}); nothing was kept. Check the URL "
                             f"(it must be a ComfyUI 0.33.0 release tarball), or set {URL_ENV} / {SHARED_ENV} to "
                             "a good copy") from None
        raise FetchError(f"{source} is not a readable .tar.gz ({e}); delete it or point at a good copy") from None


def verify(tree: str, manifest: dict[str, str]) -> list[str]:
    """The manifest's files that are missing or differ in tree, one phrase each (empty: all match)."""
    problems = []
    for rel, expected in sorted(manifest.items()):
        path = os.path.join(tree, *rel.split("/"))
        if not os.path.isfile(path):
            problems.append(f"{rel} is missing")
        elif sha256(path) != expected:
            problems.append(f"{rel} differs (sha256 {sha256(path)[:12]}..., expected {expected[:12]}...)")
    return problems


def fetch(source: str, dest: str, manifest_path: str, keep: str | None = None) -> None:
    """SOURCE (path or URL) -> verified tree at DEST, atomically; raises FetchError with nothing left behind."""
    manifest = read_manifest(manifest_path)
    staging = dest + ".partial"
    downloaded = None
    _remove(staging)
    try:
        if is_url(source):
            downloaded = (keep or dest) + ".download"
            os.makedirs(os.path.dirname(os.path.abspath(downloaded)), exist_ok=True)
            download(source, downloaded)
            tarball = downloaded
        elif os.path.isfile(source):
            tarball = source
        else:
            raise FetchError(f"no file {source}")
        unpack(tarball, staging, source)
        problems = verify(staging, manifest)
        if problems:
            more = f" and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
            raise FetchError(
                f"{source} is not stock ComfyUI 0.33.0 (upstream commit 783545f689a0): {'; '.join(problems[:SHOWN])}"
                f"{more} (checked against {manifest_path}). Nothing was installed. Use an unmodified copy: the "
                f"release tarball of tag v0.33.0, or {SHARED_ENV} / {URL_ENV} pointing at one")
        _remove(dest)
        os.replace(staging, dest)
        if downloaded and keep:
            os.replace(downloaded, keep)
    finally:
        _remove(staging)
        if downloaded:
            _remove(downloaded)


def record(tarball: str) -> str:
    """A manifest of every regular file in the tarball (paths below its top folder), sorted."""
    lines = []
    with tarfile.open(tarball) as tar:
        for m, rel in _members(tar, tarball):
            if m.isfile():
                with tar.extractfile(m) as f:
                    lines.append(f"{hashlib.sha256(f.read()).hexdigest()}  {rel}")
    return "\n".join(sorted(lines, key=lambda line: line[66:])) + "\n"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.comfyui_setup.fetch_comfyui",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", help="release tarball: a path or an http(s):// / file:// URL")
    ap.add_argument("dest", nargs="?", help="folder to install it as (replaced once the new tree verified)")
    ap.add_argument("--manifest", help="SHA-256 manifest the unpacked files must match")
    ap.add_argument("--keep", help="keep a downloaded tarball here once it verified")
    ap.add_argument("--record", metavar="TARBALL", help="print the manifest of TARBALL and exit")
    a = ap.parse_args(argv)
    try:
        if a.record:
            sys.stdout.write(record(a.record))
            return 0
        if not (a.source and a.dest and a.manifest):
            ap.print_usage(sys.stderr)
            print("error: SOURCE, DEST and --manifest are required (or --record TARBALL)", file=sys.stderr)
            return 2
        fetch(a.source, a.dest, a.manifest, a.keep)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
