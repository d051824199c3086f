"""EfficientNet image-classification training application on shoal's public API.

Layout after NVIDIA DeepLearningExamples: ``main`` (entry point), ``config`` (variants,
compound scaling, flags), ``model`` (the network), ``dataloader`` (TFRecords without
TensorFlow, image folders, synthetic data, augmentation), ``runtime`` (training loop,
optimizers, checkpoints, metrics, data-parallel backends). See ``apps/efficientnet/README.md``.
"""
