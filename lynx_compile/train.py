"""The kept command-line entry ``python -m lynx_compile.train`` (what ``torchrun`` launches for
``lynx train``): it runs :func:`lynx_compile.tools.train.main`. The code, and every name to
import, is in :mod:`lynx_compile.tools.train`."""

if __name__ == "__main__":
    import sys

    from lynx_compile.tools.train import main

    sys.exit(main())
