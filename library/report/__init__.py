"""One picture of a training run, for looking rather than reading (``python -m library.report``): loss, validation
loss, learning rate, grad norm, epoch boundaries and the sample images. ``logs.py`` finds and merges the TensorBoard
event files, ``samples.py`` collects the sample images, ``figure.py`` draws, ``cli.py`` is the command."""
