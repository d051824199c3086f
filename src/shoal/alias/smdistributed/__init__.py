"""SMDDP's package tree under the import switch (``SHOAL_AS=smddp``): ``smdistributed`` is this
package. Its TensorFlow side is ``shoal.tensorflow`` itself (see :data:`shoal.alias.KINDS`)."""
