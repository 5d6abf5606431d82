#!/usr/bin/env python3
"""Part of scripts/device-bundle.sh: turns the _stepmesh module's link command
(ninja -t commands, on stdin) into the arguments that link it again on the
device out of the bundle (stdout, one per line: .device-bundle/python/link.txt,
read by benchmarks/gpu/build_python_module.sh, which replaces @bundle@ with
the bundle's path there).

    python3 scripts/device-bundle-link.py BUILD_DIR BUNDLE_DIR < link-command

The module's own objects and the compiler's flags are dropped (the device
compiles the binding again, with its own); archives are copied into
BUNDLE/python/lib (without debug information) and named there; shared
libraries are named by their SONAME in BUNDLE/lib (device-bundle.sh copies
ldd's list there; one linked but not needed is copied here), except the C
runtime's, which become -l flags; -l and -Wl flags stay. Anything else on the
line is an error naming it, so a new kind of argument is noticed here, not on
the device."""

import os
import shlex
import shutil
import subprocess
import sys

# glibc's: the device has its own (and newer).
SYSTEM = {"libc", "libm", "libdl", "libpthread", "librt", "libgcc_s", "libstdc++", "libatomic"}


def soname(path: str) -> str:
    out = subprocess.run(["objdump", "-p", path], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == "SONAME":
            return fields[1]
    return os.path.basename(os.path.realpath(path))


def main() -> int:
    build, bundle = sys.argv[1], sys.argv[2]
    line = sys.stdin.read().strip()
    commands = [c.strip() for c in line.split("&&") if c.strip() not in ("", ":")]
    if len(commands) != 1:
        raise SystemExit(f"device-bundle-link: want one link command, got {len(commands)}")
    args = shlex.split(commands[0])[1:]  # without the compiler
    archives = os.path.join(bundle, "python", "lib")
    os.makedirs(archives, exist_ok=True)

    def carried(path: str) -> str:  # as link.txt names it: relative to the bundle
        return "@bundle@/" + os.path.relpath(path, bundle)

    def strip_copy(src: str, name: str) -> str:  # archives without debug info: the carry limit
        dst = os.path.join(archives, name)
        subprocess.run(["objcopy", "--strip-debug", src, dst], check=True)
        return carried(dst)

    out = ["-L" + carried(archives)]  # our copies of CUDA's static runtime first
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "-o":
            skip = True
        elif arg.endswith(".o") or arg in ("-shared", "-fPIC") or arg.startswith(("-O", "-g", "-D")):
            continue
        elif arg.startswith(("-l", "-Wl,", "-L")):
            out.append(arg)
        elif arg.endswith(".a"):
            path = arg if os.path.isabs(arg) else os.path.join(build, arg)
            name = os.path.basename(path)
            if name[:-2] in SYSTEM:
                out.append(f"-l{name[3:-2]}")
                continue
            out.append(strip_copy(path, name))
        elif ".so" in os.path.basename(arg):
            name = os.path.basename(arg).split(".so")[0]
            if name in SYSTEM:
                out.append(f"-l{name[3:]}")
                continue
            lib = os.path.join(bundle, "lib", soname(arg))
            if not os.path.exists(lib):  # linked, though not needed (so not in ldd's list)
                shutil.copy(os.path.realpath(arg), lib)
            out.append(carried(lib))
        else:
            raise SystemExit(f"device-bundle-link: unknown argument {arg!r} in the link line")
    # CUDA's static runtime as the -l flags name it: from this toolkit, not the device's.
    cuda = "/usr/local/cuda/lib64"
    for name in ("libcudart_static.a", "libcudadevrt.a"):
        if os.path.exists(os.path.join(cuda, name)):
            strip_copy(os.path.join(cuda, name), name)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
