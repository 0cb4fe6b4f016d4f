"""The tasks a Hugging Face model folder is exported for, by name, and the auto classes that load each.

Names only, so the command line lists them without importing transformers or the compiler;
``aotstack.integrations.hf_folder`` exports them.
"""

from __future__ import annotations

# In the order a task is inferred in: a vision-language model whose causal LM class transformers also maps
# (Gemma 3's) is exported with its images.
GENERATION_TASKS = ("image-text-to-text", "text-generation", "text2text-generation", "automatic-speech-recognition")
# One forward each, its head's outputs returned as transformers' model returns them. In the order a task is
# inferred in: an architecture some head task names is never taken for the base model.
# Each task's auto class, or None where transformers has none; and the mapping of model types to head classes that
# class reads: its name in ``transformers.models.auto.modeling_auto``, or the mapping itself.
HEAD_TASKS: dict[str, tuple[str | None, str | dict[str, str]]] = {
    "text-classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token-classification": ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "question-answering": ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
    # A question paired with each of its answers, ``[batch, choices, length]``: a score per answer (SWAG's heads).
    "multiple-choice": ("AutoModelForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"),
    "fill-mask": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    # A text encoder and an image encoder (CLIP, SigLIP): how well each image matches each text.
    "zero-shot-image-classification": (
        "AutoModelForZeroShotImageClassification", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES"
    ),
    # Boxes in an image for what texts name (OWL-ViT, OWLv2, Grounding DINO).
    "zero-shot-object-detection": (
        "AutoModelForZeroShotObjectDetection", "MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING_NAMES"
    ),
    "object-detection": ("AutoModelForObjectDetection", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES"),
    "semantic-segmentation": ("AutoModelForSemanticSegmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"),
    "depth-estimation": ("AutoModelForDepthEstimation", "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES"),
    # Keypoints of an image, their scores and descriptors, as many as it has (SuperPoint, whose forward takes one
    # image at a time when exported).
    "keypoint-detection": ("AutoModelForKeypointDetection", "MODEL_FOR_KEYPOINT_DETECTION_MAPPING_NAMES"),
    # A heatmap per keypoint of the person each image crops (ViTPose, Sapiens2).
    "pose-estimation": ("AutoModelForPoseEstimation", "MODEL_FOR_POSE_ESTIMATION_MAPPING_NAMES"),
    # An image made from an image (Swin2SR's super-resolution): each image at its own size, padded to a multiple.
    "image-to-image": ("AutoModelForImageToImage", "MODEL_FOR_IMAGE_TO_IMAGE_MAPPING_NAMES"),
    # The foreground's alpha of each image, given with its trimap as a fourth channel (ViTMatte).
    "image-matting": ("AutoModelForImageMatting", "MODEL_FOR_IMAGE_MATTING_MAPPING_NAMES"),
    "audio-classification": ("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    "audio-frame-classification": (
        "AutoModelForAudioFrameClassification", "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES"
    ),
    "audio-xvector": ("AutoModelForAudioXVector", "MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES"),
    "video-classification": ("AutoModelForVideoClassification", "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES"),
    # Masks and their classes (Mask2Former, MaskFormer, DETR's panoptic head): what the image-segmentation pipeline
    # reads.
    "image-segmentation": ("AutoModelForUniversalSegmentation", "MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES"),
    # A label, or values, for each window of a multivariate time series (PatchTST, PatchTSMixer); transformers has
    # no auto class for either, so the class is the one its mapping names for the config's model type.
    "time-series-classification": (None, "MODEL_FOR_TIME_SERIES_CLASSIFICATION_MAPPING_NAMES"),
    "time-series-regression": (None, "MODEL_FOR_TIME_SERIES_REGRESSION_MAPPING_NAMES"),
    # The next values of each channel; transformers maps these forecasting heads nowhere.
    "time-series-forecasting": (
        None, {"patchtst": "PatchTSTForPrediction", "patchtsmixer": "PatchTSMixerForPrediction"}
    ),
    # A waveform spoken from a text in one forward (VITS, MMS-TTS); models that generate audio tokens step by step
    # (Bark, MusicGen) are refused. (FastSpeech 2's forward grows its position table in place: torch.export fails.)
    "text-to-speech": ("AutoModelForTextToWaveform", "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES"),
    # Masks of what points in an image pick out (SAM, SAM 2, SAM-HQ, EdgeTAM): before feature extraction, which
    # maps the same classes and would drop the prompt.
    "mask-generation": ("AutoModelForMaskGeneration", "MODEL_FOR_MASK_GENERATION_MAPPING_NAMES"),
}
TASKS = (*GENERATION_TASKS, *HEAD_TASKS, "feature-extraction")
# Speech recognisers whose head reads the encoder alone: labels per frame (wav2vec2's, Parakeet's CTC), or a
# transducer's prediction and joint networks (Parakeet's RNN-T and TDT, aotstack.integrations.transducer).
SPEECH_HEADS = ("ctc", "rnnt", "tdt")
TASK_ALIASES = {"text2text": "text2text-generation", "causal-lm": "text-generation", "seq2seq": "text2text-generation",
                "asr": "automatic-speech-recognition", "speech-recognition": "automatic-speech-recognition",
                "sequence-classification": "text-classification", "sentiment-analysis": "text-classification",
                "ner": "token-classification", "masked-lm": "fill-mask", "vision-language": "image-text-to-text",
                "zero-shot": "zero-shot-image-classification",
                "text-to-audio": "text-to-speech", "tts": "text-to-speech"}
