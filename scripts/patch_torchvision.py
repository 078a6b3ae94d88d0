"""Guard torchvision's nms/qnms fake registrations (its CUDA wheel's ops do not load next to
CPU torch). Run with the venv's python; idempotent. scripts/install.sh runs it for .venv and .venv-vllm."""
import importlib.util, pathlib, sys
MARKER = "# kvconnect: guarded register_fake"
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
src = path.read_text()
targets = ['@torch.library.register_fake("torchvision::nms")',
           '@torch.library.register_fake("torchvision::qnms")']
anchor = "import torchvision.extension  # noqa: F401\n"
if MARKER in src:
    print("  already patched")
elif not any(t in src for t in targets):
    print("  nothing to patch")
elif anchor not in src:
    sys.exit(f"unexpected layout of {path}")
else:
    for t in targets:
        src = src.replace(t, t.replace("torch.library.register_fake", "_kvconnect_guarded_fake"))
    src = src.replace(anchor, anchor + f'''

{MARKER}: the CUDA torchvision wheel's ops do not load next to CPU torch
def _kvconnect_guarded_fake(op_name):
    def wrapper(fn):
        if torchvision.extension._has_ops():
            return torch.library.register_fake(op_name)(fn)
        return fn

    return wrapper
''', 1)
    path.write_text(src)
    print(f"  patched {path}")
