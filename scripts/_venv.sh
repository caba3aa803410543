# Sourced by scripts/demo and scripts/test: create or reuse .venv and install what is needed.
# Reinstalls only when pyproject.toml or constraints/dev.txt changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${XPUKIT_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "xpukit: creating virtualenv $venv" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.xpukit-install-stamp"
if [ "${XPUKIT_SKIP_INSTALL:-0}" = "1" ]; then
  # Use the environment as it is (e.g. a venv with the XPU or CUDA build of torch and
  # `pip install -e ".[dev]"` done by hand): installing the pinned CPU set would replace that torch.
  export PATH="$venv/bin:$PATH"
  return 0 2>/dev/null || exit 0
fi
want="$(cat "$root/pyproject.toml" "$root/constraints/dev.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "xpukit: installing the pinned dev/test set into $venv (first run takes a few minutes)" >&2
  # torch first, pinned, so nothing below can pull a multi-GB CUDA build in its place.
  # XPUKIT_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) picks where that torch comes
  # from; unset, pip's own configuration decides (here: a CPU build on local disk).
  torch_pin="$(grep -E '^torch==' "$root/constraints/dev.txt")"
  index_args=()
  if [ -n "${XPUKIT_TORCH_INDEX:-}" ]; then index_args=(--index-url "$XPUKIT_TORCH_INDEX"); fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${index_args[@]}" "$torch_pin"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -c "$root/constraints/dev.txt" -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
