"""SDXL size conditioning: original size, crop top-left and target size of each training image.

sd-scripts (``library/train_util.py`` ``BaseDataset.__getitem__``, ``trim_and_resize_if_required``,
``BucketManager.get_crop_ltrb``) computes, per image, in pixels:

* original size: the image's size before any resize (W, H);
* crop: ``get_crop_ltrb(bucket, original size)``, where the aspect-preserving fit of the image lies in the bucket
  (``library.data.buckets.crop_ltrb``). A random crop does not change it (upstream: "no idea how to reflect" it);
  a horizontal flip makes the left ``target width - crop right``;
* target size: the bucket (W, H).

Without bucketing and without cached latents, upstream crops to the resolution first and records the cropped size
as the original, with a zero crop (so a flip gives a left of the full width); with cached latents it stores the
bucketed values above. The UNet receives ``(orig_h, orig_w, crop_top, crop_left, target_h, target_w)``, each number
embedded as a 256-wide sinusoid (cos half first), as upstream's ``sdxl_train_util.get_size_embeddings``.
"""

from __future__ import annotations

from library.data.buckets import crop_ltrb

SizeCondition = tuple[int, int, int, int, int, int]


def size_condition(original_size: tuple[int, int], crop: tuple[float, float, float, float],
                   target_size: tuple[int, int], flipped: bool) -> SizeCondition:
    """``(orig_h, orig_w, crop_top, crop_left, target_h, target_w)`` from sizes (W, H) and a crop (l, t, r, b)."""
    left = target_size[0] - crop[2] if flipped else crop[0]
    return (int(original_size[1]), int(original_size[0]), int(crop[1]), int(left), int(target_size[1]),
            int(target_size[0]))


def image_size_condition(image_size: tuple[int, int], bucket: tuple[int, int], *, bucketed: bool,
                         flipped: bool) -> SizeCondition:
    """The size condition of an image of ``image_size`` trained at ``bucket`` (both W, H), as upstream: bucketed
    (or from cached latents) the fit of the image in the bucket, else the bucket itself with a zero crop."""
    if bucketed:
        return size_condition(image_size, crop_ltrb(bucket, image_size), bucket, flipped)
    return size_condition(bucket, (0, 0, 0, 0), bucket, flipped)
