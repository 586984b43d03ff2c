"""Training data: image/caption discovery, bucketing, caption transforms, batching and the latent cache.

Entry point: ``build_train_data(data_config, seed=...)`` → ``TrainData`` (see ``library/data/dataset.py``).
"""

from library.data.dataset import TrainData, build_train_data

__all__ = ["TrainData", "build_train_data"]
