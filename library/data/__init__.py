"""Training data: image/caption discovery, bucketing, caption transforms, batching and the latent cache.

Entry point: ``library.data.dataset.build_train_data(data_config, seed=...)`` → ``TrainData``. This file imports
nothing, so that a module of the package can import a sibling without running the whole package first.
"""
