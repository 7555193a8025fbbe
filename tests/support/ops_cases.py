"""The image cases every PodmanOps answers alike (sandbox/podman_ops.py): the real ones on the
provider's Podman and FakeOps (sandbox/fake.py), through this one body
(tests/integration/test_podman_ops.py)."""

from __future__ import annotations

from typing import Any


def image_cases(ops: Any, image: str, mark: str) -> dict[str, Any]:
    """What `ops` says of `image` (present), of a name that is not there, and of two more
    names given to `image` and removed again."""
    missing = f"localhost/ops-{mark}/none:x"
    a, b = f"localhost/ops-{mark}/img:a", f"localhost/ops-{mark}/img:b"
    out: dict[str, Any] = {
        "present": [(ops.image_size(image) or 0) > 0, isinstance(ops.image_env(image), list),
                    bool(ops.image_layers(image)), isinstance(ops.image_id(image), str),
                    image in ops.images()],
        "missing": [ops.image_size(missing), ops.image_env(missing), ops.image_layers(missing),
                    ops.image_id(missing)]}
    ops.remove_image(missing)  # harmless
    ops.tag(image, a)
    ops.tag(a, b)
    out["tagged"] = [ops.image_size(a) == ops.image_size(b) == ops.image_size(image),
                     ops.image_id(a) == ops.image_id(image) or None, a in ops.images()]
    ops.remove_image(a)
    out["one_name_left"] = [ops.image_size(a), ops.image_size(b) is not None,
                            ops.image_size(image) is not None]
    ops.remove_image(b)
    out["gone"] = [ref for ref in ops.images() if ref.startswith(f"localhost/ops-{mark}/")]
    return out
