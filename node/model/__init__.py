"""The model and its replica: the plain GPT, Hugging Face configs and weights, meta-device init, the replica the loop trains (in this process or over local workers), export and sampling."""
