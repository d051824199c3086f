"""The EfficientNet application on TensorFlow 2 + Keras 3 through ``shoal.keras``
(``--framework tensorflow``): the seed's own workload, as Horovod and SMDDP ran it.

``data``: ``tf.data`` pipelines over the same TFRecords (sharded per rank), synthetic images;
``model``: ``keras.applications`` EfficientNet B0-B7 (``weights=None``), optimizer and schedule;
``train``: ``model.fit`` with shoal's ``DistributedOptimizer`` and callbacks, evaluation,
checkpoints and the application's metrics.
"""
