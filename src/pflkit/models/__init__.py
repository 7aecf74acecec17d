"""Model zoo: every model is a :class:`PFLModel` = ``body`` (features) + ``head`` (classifier).

``build_model(name, input_shape, num_classes, **options)`` builds one; ``MODELS`` lists them
(``pflkit list``). State-dict keys start with ``body.`` or ``head.``, which is how algorithms
split shared and private parts. Each entry's description says whether it follows a paper's text
or an author's code; the docstrings of the factory functions give the layers.

| name | source | where |
|---|---|---|
| ``mlp`` | FedAvg 2NN / logistic regression | ``mlp.py`` |
| ``map_mlpnet``, ``map_lenet``, ``tfcnn``, ``vgg8``, ``vgg8_bn``, ``vgg11``, ``resnet20``, \
``resnet56``, ``femnist_cnn`` | MAP code (lxcnju/MAP) | ``mlp.py``, ``cnn.py``, ``vgg.py``, \
``resnet.py`` |
| ``cnn4`` | PFLlib ``FedAvgCNN`` (GPFL) | ``cnn.py`` |
| ``resnet18`` | KT-pFL code (cifar stem), torchvision (imagenet stem, GPFL) | ``resnet.py`` |
| ``lenet5_bn`` | pFedSim paper Table 5 / FL-bench code | ``cnn.py`` |
| ``mobilenet_v2`` | torchvision's MobileNetV2 (pFedSim, FL-bench code) | ``mobilenet.py`` |
| ``lenet5`` | KT-pFL code's LeNet | ``cnn.py`` |
| ``fedproto_cnn`` | FedProto code (pFedPM) | ``cnn.py`` |
| ``har_cnn`` | GPFL/PFLlib code's HARCNN (UCI HAR) | ``har.py`` |
| ``fasttext``, ``amazon_mlp`` | GPFL code's fastText (AG News), KD3A's AmazonMLP | ``text.py`` |
"""

from pflkit.models.base import ModelInfo, PFLModel
from pflkit.models.registry import MODELS, build_model, model_options

__all__ = ["MODELS", "ModelInfo", "PFLModel", "build_model", "model_options"]
