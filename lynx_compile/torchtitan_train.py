"""The kept command-line entry ``python -m lynx_compile.torchtitan_train`` (torchtitan's training
step under ``torchrun``): it runs :func:`lynx_compile.tools.torchtitan_train.main`. The code, and
every name to import, is in :mod:`lynx_compile.tools.torchtitan_train`."""

if __name__ == "__main__":
    import sys

    from lynx_compile.tools.torchtitan_train import main

    sys.exit(main())
