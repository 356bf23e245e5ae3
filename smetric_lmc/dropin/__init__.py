"""Drop-in compatibility with stacks users already run: ``smetric router`` takes vLLM
production-stack's router arguments and routes (``router.py``, ``args.py``), with Kubernetes pod
discovery (``k8s.py``) and engines joining and leaving a running controller (``membership.py``)."""
