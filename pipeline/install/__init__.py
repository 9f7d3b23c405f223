"""`make setup` and `make bundle`: which software stack (CPU or GPU) a machine gets, installing it into .venv (from
an index, from a bundle with no network, or on top of an existing Python), and writing bundles for offline hosts.

Standard library only: this package runs before anything is installed, under whatever Python the user names.
"""
