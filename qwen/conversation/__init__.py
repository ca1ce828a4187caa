"""附录 · 对话的提示词与多轮对话：谁来把消息变成 token，留下的状态怎么接着用。

- prompt.py：Prompt，提示词唯一的主人——用哪个模板（发布的 Qwen3.5 模板即第 13 章的 build_prompt、检查点自己的、没有模板），
  模板的参数（chat_template_kwargs）收不收，渲染出什么（token、其中的图、是否以没合上的 <think> 结尾）；客户的文字只是文字；
- template.py：检查点自己的对话模板，在 jinja2 的沙箱里渲染；
- turns.py：Conversation，多轮对话不重读历史、有草稿头就投机解码；Resume，读到某处的一份状态（服务的前缀缓存也用它）。
"""

from .prompt import Prompt, Rendered
from .turns import Conversation, Resume, cut_point, generation_defaults, template_defaults

__all__ = ["Conversation", "Prompt", "Rendered", "Resume", "cut_point", "generation_defaults", "template_defaults"]
