"""nnU-Net v2 trained models read into autoseg (``autoseg import-nnunet``): nnU-Net's files are read, never its code.

Owns: ``importer`` (``import_nnunet``, the entry function: a model folder -> an autoseg model archive), ``folder``
(the model folder's JSON files as an autoseg plan and fingerprint: ``read_model_folder``), ``network`` (the
PlainConvUNet or ResidualEncoderUNet plans.json names, in either plans layout, as a ``plain_unet`` or
``residual_encoder_unet`` topology), ``cascade`` (a 3d_cascade_fullres model folder and its 3d_lowres one as one
plan of both), ``axes`` (``transpose_forward``:
the plan's sizes and the kernels in the image's own axis order), ``checkpoint`` (nnU-Net's
``checkpoint_final.pth`` read with ``weights_only`` and its state dict mapped onto autoseg's network).

Imports: ``predict`` (the archive writer) and the packages below it; it sits beside ``train`` and ``selection``,
which it does not import.
"""
