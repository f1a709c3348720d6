"""`python -m dlrm_lab.model.native`: build the lab's C++ kernels (or find them built), as `make install` does, so
that no run and no test builds them first; says why where they cannot be (torch's ops serve then)."""

from dlrm_lab.model import native

print(native.load() or "the lab's C++ kernels: built")
