"""A fourth model family that lives only in the tests: a toy denoiser with its own record (``spec.py``), behaviour
(``family.py``) and entry point (``toy_train_network``), entered into the registry by a test
(``tests/e2e/test_toy_family.py``). No file outside ``tests/`` knows it, which is what it proves: a family is its
package, one registry entry and its entry script."""
