"""Media on the trainer's side: decode and preprocess images, audio and video, group them per micro-batch, and encode
each unique item once with the exact gradient of every micro-batch.

* :mod:`knitdata.media.process`: decoding and preprocessing (``image_item``, ``audio_item``, ``patchify``,
  :class:`~knitdata.media.process.MediaProcessor`), provenance keys;
* :mod:`knitdata.media.video`: video items and frame sampling;
* :mod:`knitdata.media.multimodal`: :class:`~knitdata.media.multimodal.MultimodalCollator` and the
  :class:`~knitdata.media.multimodal.MediaTable` of a micro-batch's unique items;
* :mod:`knitdata.media.encoder`: :class:`~knitdata.media.encoder.SharedEncoding` (encode once per mini-batch).

Where media are stored once (one copy per digest in a storage unit) is storage's concern:
:mod:`knitdata.storage.media`.
"""
