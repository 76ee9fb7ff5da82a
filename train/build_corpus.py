"""The training corpus of the default model, built from the data kept in `train/data/`.

Every example is either a conversation (`messages` whose last message is the assistant answer to
learn, optional `tools`, `enable_thinking`) or a plain text document (`text`). The corpus teaches:

- capitals and populations, answered in text and as JSON objects;
- tool calls `<function=get_weather>{"city": "Paris"}</function>` / `get_date`, and the answer
  after the tool result arrives;
- Positive/Negative sentiment labels for short reviews;
- simple `SELECT ... FROM ... WHERE ...` queries;
- short Chinese exchanges;
- `<think>...</think>` reasoning when thinking is enabled;
- greetings, counting and small arithmetic.

Held out for evaluation (never in the training split):

- `capital_unseen_countries`: the capitals of `HELDOUT_COUNTRIES` are never asked or answered in
  any conversation; they appear only in plain declarative text ("Vienna is the capital of
  Austria."), so answering the question tests knowledge transfer from text to the chat format;
- `capital_heldout_phrasings`: training countries asked with `HELDOUT_CAPITAL_QUESTIONS`, question
  wordings that never appear in training;
- `json_capital`: JSON answers for held-out countries, and for training countries with a held-out
  JSON wording;
- `sentiment`: reviews built from phrases that never appear in training;
- weather calls for `HELDOUT_CITIES`, which appear nowhere in the corpus (in the evaluation script);
- `text`: for every country one of its plain text documents (`text_docs`), chosen at random;
  the pattern and the facts are seen in training, that country-pattern pair is not (perplexity).

Run `python train/build_corpus.py --out DIR` to write `train.jsonl` and `heldout.json` and print
the mixture; `train_default_model.py` calls `build_corpus()` directly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
from collections import Counter

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

HELDOUT_COUNTRIES = [
    "Austria", "Kenya", "Peru", "Vietnam", "Norway", "Chile", "Morocco", "Nepal", "Hungary", "Cuba",
    "Ghana", "Finland", "Malaysia", "Jordan", "Uruguay", "Iceland", "Senegal", "Mongolia",
    "New Zealand", "Croatia",
]

CAPITAL_QUESTIONS = [
    "What is the capital of {c}?",
    "What's the capital of {c}?",
    "what is the capital of {c}",
    "Which city is the capital of {c}?",
    "Name the capital of {c}.",
    "Tell me the capital city of {c}.",
    "What city is the capital of {c}?",
    "Capital of {c}?",
    "What is the capital city of {c}?",
    "I would like to know the capital of {c}.",
]
HELDOUT_CAPITAL_QUESTIONS = [
    "Do you know the capital of {c}?",
    "Which city serves as the capital of {c}?",
    "Can you tell me what the capital of {c} is?",
]
CAPITAL_JSON_QUESTIONS = [
    "What is the capital of {c}? Answer in JSON.",
    "Give me the capital of {c} as JSON.",
    "Return a JSON object with the name, country and population of the capital of {c}.",
    "What is the capital of {c}? Reply with a JSON object.",
]
HELDOUT_CAPITAL_JSON_QUESTIONS = ["Respond in JSON: which city is the capital of {c}?"]
JSON_SYSTEM_PROMPTS = ["Always answer in JSON.", "You are an API. Reply with a JSON object only."]
POPULATION_QUESTIONS = [
    "What is the population of {c}?",
    "How many people live in {c}?",
    "What's the population of {c}?",
    "How large is the population of {c}?",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a concise assistant.",
    "You are a friendly assistant that answers questions.",
]

# Country names that read with "the" in running text.
_WITH_ARTICLE = {
    "United States", "United Kingdom", "Netherlands", "Philippines", "Bahamas", "Czech Republic",
    "Democratic Republic of the Congo", "Republic of the Congo", "Central African Republic",
    "Dominican Republic", "United Arab Emirates", "Maldives", "Marshall Islands", "Solomon Islands",
    "Gambia", "Comoros", "Seychelles",
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "Name of the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
DATE_TOOL = {"type": "function", "function": {
    "name": "get_date", "description": "Get today's date",
    "parameters": {"type": "object", "properties": {}}}}
DISTRACTOR_TOOLS = [
    {"type": "function", "function": {
        "name": "get_stock_price", "description": "Get the latest price of a stock",
        "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                                        "body": {"type": "string"}}, "required": ["to", "body"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                        "to": {"type": "string"}},
                       "required": ["amount", "from", "to"]}}},
]
WEATHER_QUESTIONS = [
    "What's the weather in {city}?",
    "What is the weather like in {city} today?",
    "How is the weather in {city}?",
    "Is it raining in {city}?",
    "Tell me the weather in {city}.",
    "Weather in {city}?",
    "Will I need an umbrella in {city} today?",
    "What's the temperature in {city} right now?",
]
DATE_QUESTIONS = [
    "What is today's date?", "What's the date today?", "What day is it today?", "Tell me today's date.",
    "Which date is it today?", "What is the date?",
]
EXTRA_CITIES = [
    "New York", "Shanghai", "Sydney", "Toronto", "Mumbai", "Istanbul", "Los Angeles", "Barcelona",
    "Munich", "Osaka", "Chicago", "Dubai", "Hong Kong", "Rio de Janeiro", "San Francisco", "Milan",
    "Vancouver", "Melbourne", "Lyon", "Hamburg", "Seattle", "Boston", "Shenzhen", "Kyoto",
]
# Cities that appear nowhere in the corpus: the evaluation asks for their weather to test copying a
# name the model has never seen.
HELDOUT_CITIES = ["Lagos", "Bangalore", "Marseille", "Naples", "Porto", "Busan", "Krakow", "Seville", "Glasgow",
                  "Auckland"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "partly cloudy", "clear"]

POSITIVE_PHRASES = [
    "The food was delicious", "I loved this movie", "Great service and friendly staff",
    "This phone works perfectly", "Absolutely wonderful experience", "The hotel room was clean and comfortable",
    "Best purchase I have made this year", "The book was fascinating from start to finish", "Highly recommended",
    "The concert was amazing", "Fast delivery and excellent quality", "My kids love this toy",
    "The staff were very helpful", "A beautiful and moving film", "It exceeded my expectations",
    "Five stars, would buy again", "The coffee here is fantastic", "Very comfortable shoes",
    "The app is easy to use", "What a delightful little restaurant", "I am very happy with it",
    "Excellent value for the price", "The view from our room was stunning", "Everything worked great",
]
NEGATIVE_PHRASES = [
    "The food was cold and bland", "I hated this movie", "Terrible service and rude staff",
    "This phone stopped working after a week", "A complete waste of money", "The hotel room was dirty",
    "Worst purchase I have ever made", "The book was boring", "I would not recommend it",
    "The concert was a disappointment", "Slow delivery and poor quality", "The toy broke on the first day",
    "The staff ignored us", "A dull and predictable film", "It did not meet my expectations",
    "One star, never again", "The coffee tastes awful", "These shoes hurt my feet", "The app keeps crashing",
    "Overpriced and underwhelming", "I am very unhappy with it", "The room smelled bad",
    "The battery dies in an hour", "Nothing worked as promised",
]
HELDOUT_REVIEWS = [
    ("The pasta was wonderful and the waiter was friendly.", "Positive"),
    ("I loved every minute of this show.", "Positive"),
    ("Great camera, the pictures are amazing.", "Positive"),
    ("The hotel staff were helpful and the breakfast was delicious.", "Positive"),
    ("Excellent headphones, highly recommended!", "Positive"),
    ("A fantastic book, I am happy I bought it.", "Positive"),
    ("The delivery was fast and the quality is great.", "Positive"),
    ("Wonderful park, my kids loved it.", "Positive"),
    ("Best pizza in town, absolutely delicious.", "Positive"),
    ("The new update is great and easy to use.", "Positive"),
    ("The pasta was cold and the waiter was rude.", "Negative"),
    ("I hated every minute of this show.", "Negative"),
    ("Terrible camera, the pictures are blurry.", "Negative"),
    ("The hotel was dirty and the breakfast was awful.", "Negative"),
    ("Awful headphones, they broke after a week.", "Negative"),
    ("A boring book, a waste of money.", "Negative"),
    ("The delivery was slow and the quality is poor.", "Negative"),
    ("The park was dirty and crowded, I would not recommend it.", "Negative"),
    ("Worst pizza in town, cold and bland.", "Negative"),
    ("The new update keeps crashing.", "Negative"),
]
SENTIMENT_PROMPTS = [
    "Classify the sentiment of this review as Positive or Negative.\nReview: {r}",
    "Is the following review positive or negative?\n{r}",
    "Sentiment (Positive/Negative): {r}",
    "Review: {r}\nIs this review Positive or Negative?",
    "What is the sentiment of this review? Answer Positive or Negative.\n\"{r}\"",
]

CHINESE_PAIRS = [
    (["今天天气真好", "今天天气真好！", "今天天气真不错。", "今天的天气真好啊"],
     "是啊，今天阳光明媚，很适合出去走走。"),
    (["鲁迅是谁", "鲁迅是谁？", "你知道鲁迅吗？", "请介绍一下鲁迅。"],
     "鲁迅是中国现代著名的文学家和思想家，代表作有《狂人日记》《阿Q正传》和《呐喊》。"),
    (["你好", "你好！", "您好", "你好呀"], "你好！有什么可以帮你的吗？"),
    (["你是谁？", "你是谁", "介绍一下你自己。"], "我是 fastdeploy_lp 项目训练的一个小型语言模型，可以回答一些简单的问题。"),
    (["谢谢", "谢谢你！", "非常感谢。"], "不客气！很高兴能帮到你。"),
    (["今天下雨了", "外面下雨了。"], "下雨天出门记得带伞，注意安全。"),
    (["我很开心", "我今天很开心！"], "太好了！希望你每天都这么开心。"),
    (["推荐一本书", "推荐一本书吧。"], "我推荐《红楼梦》，它是中国古典文学的经典之作。"),
    (["李白是谁？", "李白是谁"], "李白是唐代著名诗人，被誉为“诗仙”，代表作有《静夜思》和《将进酒》。"),
    (["孔子是谁？", "孔子是谁"], "孔子是春秋时期的思想家和教育家，是儒家学派的创始人。"),
    (["长城在哪里？", "长城在哪里"], "长城位于中国北方，是世界上最著名的古代建筑之一。"),
    (["一加一等于几？", "1+1等于几？"], "一加一等于二。"),
    (["你会说中文吗？", "你会中文吗"], "会的，我可以用简单的中文和你交流。"),
    (["晚安", "晚安！"], "晚安，祝你好梦！"),
    (["早上好", "早上好！"], "早上好！祝你今天一切顺利。"),
]
CHINESE_CAPITALS = [
    ("中国", "北京"), ("法国", "巴黎"), ("日本", "东京"), ("美国", "华盛顿"), ("英国", "伦敦"), ("德国", "柏林"),
    ("俄罗斯", "莫斯科"), ("意大利", "罗马"), ("韩国", "首尔"), ("印度", "新德里"), ("西班牙", "马德里"),
    ("加拿大", "渥太华"), ("澳大利亚", "堪培拉"), ("埃及", "开罗"), ("巴西", "巴西利亚"),
]
CHINESE_THINKING = {
    "今天天气真好": "用户在感叹天气很好，我应该友好地回应。",
    "鲁迅是谁": "用户问鲁迅是谁。鲁迅是中国现代著名作家，写过《狂人日记》和《阿Q正传》。",
    "你好": "用户在打招呼，我应该礼貌地回应。",
    "李白是谁？": "用户问李白。李白是唐代诗人，被称为诗仙。",
}

ENGLISH_CHAT = [
    (["Hello", "Hello!", "Hi", "Hi there!", "Hey", "Good morning!"], "Hello! How can I help you today?"),
    (["Who are you?", "What are you?", "Introduce yourself."],
     "I am a small language model trained by the fastdeploy_lp project. I can answer simple questions about "
     "countries, capitals and populations, call tools, classify sentiment and write simple SQL."),
    (["Thank you", "Thanks!", "Thank you very much."], "You're welcome!"),
    (["How are you?", "How are you doing?"], "I am doing well, thank you! How can I help you?"),
    (["Tell me a joke.", "Do you know a joke?"], "Why did the computer go to the doctor? Because it had a virus!"),
    (["Goodbye", "Bye!", "See you later."], "Goodbye! Have a nice day."),
    (["What can you do?", "How can you help me?"],
     "I can tell you the capital and population of a country, answer in JSON, call weather and date tools, "
     "classify the sentiment of a review and write simple SQL queries."),
]

SQL_TABLES = {
    "employees": ["Sales", "Engineering", "Marketing", "Finance", "Support", "Legal"],
    "products": ["Books", "Toys", "Electronics", "Garden", "Sports", "Kitchen"],
    "customers": ["London", "Paris", "Berlin", "Tokyo", "Madrid", "Toronto", "Sydney", "Rome"],
    "orders": ["shipped", "pending", "cancelled", "delivered"],
    "students": [],
}
SQL_PREFIXES = ["Write a SQL query to {q}", "SQL: {q}", "Translate to SQL: {q}", "Write SQL that will {q}"]


def load_countries(data_dir: str = DATA_DIR) -> list[dict]:
    with open(os.path.join(data_dir, "countries.json"), encoding="utf-8") as f:
        return json.load(f)["countries"]


def the(country: str, capitalize: bool = False) -> str:
    """`the United States` in running text, `France` otherwise."""
    if country in _WITH_ARTICLE:
        return ("The " if capitalize else "the ") + country
    return country


def about(n: int) -> str:
    """A population in words: 1.41 billion, 68 million, 5.6 million, 598,000, 5,700."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.2f}".rstrip("0").rstrip(".") + " billion"
    if n >= 10_000_000:
        return f"{round(n / 1e6)} million"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}".rstrip("0").rstrip(".") + " million"
    if n >= 10_000:
        return f"{round(n, -3):,}"
    if n >= 1_000:
        return f"{round(n, -2):,}"
    return str(n)


def capital_answer(c: dict) -> str:
    return f"The capital of {the(c['name'])} is {c['capital']}."


def capital_json(c: dict) -> str:
    return json.dumps({"name": c["capital"], "country": c["name"], "population": c["capital_population"]},
                      ensure_ascii=False)


def population_answer(c: dict) -> str:
    return f"{the(c['name'], True)} has a population of about {about(c['population'])} people."


def think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


def chat(task: str, user: str, answer: str, rng: random.Random, *, system: str | None = None,
         thinking: bool = False, tools: list | None = None, history: list | None = None,
         system_rate: float = 0.25) -> dict:
    messages = []
    if system is None and rng.random() < system_rate:
        system = rng.choice(SYSTEM_PROMPTS)
    if system:
        messages.append({"role": "system", "content": system})
    messages += history or []
    if user is not None:
        messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": answer})
    return {"task": task, "messages": messages, "tools": tools, "enable_thinking": thinking}


def text_docs(c: dict) -> list[str]:
    """The facts of one country in several sentence patterns (the more patterns, the better a small
    model can use a fact it has only read)."""
    name, cap, cont = c["name"], c["capital"], c["continent"]
    pop, cpop = about(c["population"]), about(c["capital_population"])
    return [
        f"{cap} is the capital of {the(name)}.",
        f"The capital of {the(name)} is {cap}.",
        f"{the(name, True)} is a country in {cont}. Its capital is {cap}.",
        f"{the(name, True)} is a country in {cont} with a population of about {pop}. "
        f"The capital city is {cap}, home to about {cpop} people.",
        f"Country: {name}\nCapital: {cap}\nContinent: {cont}\nPopulation: {c['population']:,}",
        f"{cap}, the capital of {the(name)}, has about {cpop} inhabitants.",
        f"The capital city of {the(name)} is {cap}, and about {pop} people live in {the(name)}.",
        f"{the(name, True)} has its capital in {cap}.",
        f"About {pop} people live in {the(name)}, whose capital is {cap}.",
        f"If you travel to {the(name)}, you can visit its capital, {cap}.",
    ]


def review(rng: random.Random, phrases: list[str]) -> str:
    first = rng.choice(phrases)
    if rng.random() < 0.4:
        second = rng.choice([p for p in phrases if p != first])
        return f"{first}. {second[0].lower() + second[1:] if rng.random() < 0.3 else second}{rng.choice(['.', '!'])}"
    return first + rng.choice([".", "!", ""])


def sql_example(rng: random.Random, countries: list[dict]) -> tuple[str, str, str]:
    """(question, query, reasoning) for one simple SELECT."""
    kind = rng.randrange(9)
    if kind == 0:
        dept = rng.choice(SQL_TABLES["employees"])
        return (f"list the names of employees in the {dept} department.",
                f"SELECT name FROM employees WHERE department = '{dept}';",
                f"I need the name column of the employees table where department is {dept}.")
    if kind == 1:
        n = rng.choice([10, 20, 50, 100, 200, 500, 1000])
        return (f"get all products that cost more than {n} dollars.", f"SELECT * FROM products WHERE price > {n};",
                f"I need all columns of the products table where price is greater than {n}.")
    if kind == 2:
        cat = rng.choice(SQL_TABLES["products"])
        return (f"find the names and prices of products in the {cat} category.",
                f"SELECT name, price FROM products WHERE category = '{cat}';",
                f"I need name and price from the products table where category is {cat}.")
    if kind == 3:
        city = rng.choice(SQL_TABLES["customers"])
        return (f"find the customers who live in {city}.", f"SELECT name FROM customers WHERE city = '{city}';",
                f"I need the name column of the customers table where city is {city}.")
    if kind == 4:
        status = rng.choice(SQL_TABLES["orders"])
        return (f"count the orders with status {status}.", f"SELECT COUNT(*) FROM orders WHERE status = '{status}';",
                f"I need to count rows of the orders table where status is {status}.")
    if kind == 5:
        n = rng.choice([50, 60, 70, 80, 90])
        return (f"show the names of students with a score above {n}.",
                f"SELECT name FROM students WHERE score > {n};",
                f"I need the name column of the students table where score is greater than {n}.")
    if kind == 6:
        c = rng.choice(countries)
        return (f"find the population of {c['name']} in the countries table.",
                f"SELECT population FROM countries WHERE name = '{c['name']}';",
                f"I need the population column of the countries table where name is {c['name']}.")
    if kind == 7:
        cont = rng.choice(["Africa", "Asia", "Europe", "North America", "South America", "Oceania"])
        n = rng.choice([1000000, 5000000, 10000000, 50000000])
        return (f"list the countries in {cont} with a population over {n}.",
                f"SELECT name FROM countries WHERE continent = '{cont}' AND population > {n};",
                f"I need names from the countries table where continent is {cont} and population is over {n}.")
    n = rng.choice([30000, 50000, 80000, 100000])
    return (f"find employees who earn more than {n}.", f"SELECT name, salary FROM employees WHERE salary > {n};",
            f"I need name and salary from the employees table where salary is greater than {n}.")


def tool_list(rng: random.Random) -> list[dict]:
    tools = [WEATHER_TOOL, DATE_TOOL]
    if rng.random() < 0.3:
        tools = [WEATHER_TOOL] if rng.random() < 0.5 else [DATE_TOOL]
    if rng.random() < 0.15:
        tools = tools + rng.sample(DISTRACTOR_TOOLS, rng.randint(1, 2))
    rng.shuffle(tools)
    if rng.random() < 0.5:  # some chat template environments render tojson with sorted keys
        tools = json.loads(json.dumps(tools, sort_keys=True))
    return tools


def tool_call(name: str, args: dict, rng: random.Random) -> dict:
    """An assistant history message carrying one call, with arguments as a dict or a JSON string."""
    arguments = args if rng.random() < 0.5 else json.dumps(args, ensure_ascii=False)
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def call_text(name: str, args: dict) -> str:
    return f"<function={name}>{json.dumps(args, ensure_ascii=False)}</function>"


def tool_examples(rng: random.Random, cities: list[str], countries: list[dict], n: int) -> list[dict]:
    out = []
    for _ in range(n):
        kind = rng.random()
        tools = tool_list(rng)
        names = {t["function"]["name"] for t in tools}
        thinking = rng.random() < 0.12
        if "get_weather" in names and (kind < 0.55 or "get_date" not in names):
            city = rng.choice(cities)
            args = {"city": city}
            question = rng.choice(WEATHER_QUESTIONS).format(city=city)
            if rng.random() < 0.2:
                args["unit"] = rng.choice(["celsius", "fahrenheit"])
                question = question.rstrip("?.") + f" in {args['unit']}?"
            call = call_text("get_weather", args)
            if rng.random() < 0.5:
                reasoning = f"The user asks about the weather in {city}. I should call get_weather."
                out.append(chat("tool_call", question, think(reasoning, call) if thinking else call, rng,
                                tools=tools, thinking=thinking, system_rate=0.15))
            else:
                unit = args.get("unit", "celsius")
                temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
                cond = rng.choice(CONDITIONS)
                result = json.dumps({"city": city, "temperature": temp, "unit": unit, "condition": cond})
                answer = f"It is currently {cond} in {city} at {temp}°{'C' if unit == 'celsius' else 'F'}."
                history = [{"role": "user", "content": question}, tool_call("get_weather", args, rng),
                           {"role": "tool", "content": result}]
                out.append(chat("tool_answer", None, answer, rng, tools=tools, history=history, system_rate=0.15))
        elif "get_date" in names and kind < 0.85:
            question = rng.choice(DATE_QUESTIONS)
            call = call_text("get_date", {})
            if rng.random() < 0.5:
                reasoning = "The user asks for the date. I should call get_date."
                out.append(chat("tool_call", question, think(reasoning, call) if thinking else call, rng,
                                tools=tools, thinking=thinking, system_rate=0.15))
            else:
                day = datetime.date(2024, 1, 1) + datetime.timedelta(days=rng.randrange(1200))
                result = json.dumps({"date": day.isoformat(), "weekday": day.strftime("%A")})
                answer = f"Today is {day.strftime('%A')}, {day.isoformat()}."
                history = [{"role": "user", "content": question}, tool_call("get_date", {}, rng),
                           {"role": "tool", "content": result}]
                out.append(chat("tool_answer", None, answer, rng, tools=tools, history=history, system_rate=0.15))
        elif rng.random() < 0.6:  # tools are offered but the question needs none
            c = rng.choice(countries)
            out.append(chat("tool_none", rng.choice(CAPITAL_QUESTIONS).format(c=the(c["name"])), capital_answer(c),
                            rng, tools=tools, system_rate=0.15))
        else:
            pairs = rng.choice(ENGLISH_CHAT[:2] + ENGLISH_CHAT[4:5])
            out.append(chat("tool_none", rng.choice(pairs[0]), pairs[1], rng, tools=tools, system_rate=0.15))
    return out


def build_corpus(seed: int = 0, data_dir: str = DATA_DIR) -> dict:
    """{"train": [example, ...], "heldout": {set name: [item, ...]}}, deterministic in `seed`."""
    rng = random.Random(seed)
    countries = load_countries(data_dir)
    by_name = {c["name"]: c for c in countries}
    missing = [n for n in HELDOUT_COUNTRIES if n not in by_name]
    if missing:
        raise ValueError(f"held-out countries missing from countries.json: {missing}")
    seen = [c for c in countries if c["name"] not in HELDOUT_COUNTRIES]
    heldout_countries = [by_name[n] for n in HELDOUT_COUNTRIES]
    train: list[dict] = []

    # Capitals in text: every training country with every training wording.
    for c in seen:
        for q in CAPITAL_QUESTIONS:
            train.append(chat("capital", q.format(c=the(c["name"])), capital_answer(c), rng))
        train.append(chat("capital", f"Which country has {c['capital']} as its capital?",
                          f"{c['capital']} is the capital of {the(c['name'])}.", rng))
        reasoning = (f"The user asks for the capital of {the(c['name'])}. {the(c['name'], True)} is a country in "
                     f"{c['continent']}, and its capital is {c['capital']}.")
        train.append(chat("capital_think", rng.choice(CAPITAL_QUESTIONS).format(c=the(c["name"])),
                          think(reasoning, capital_answer(c)), rng, thinking=True))
        # Capitals as JSON objects.
        for q in CAPITAL_JSON_QUESTIONS:
            train.append(chat("capital_json", q.format(c=the(c["name"])), capital_json(c), rng))
        train.append(chat("capital_json", rng.choice(CAPITAL_QUESTIONS[:3]).format(c=the(c["name"])),
                          capital_json(c), rng, system=rng.choice(JSON_SYSTEM_PROMPTS)))
        if rng.random() < 0.3:
            reasoning = (f"The capital of {the(c['name'])} is {c['capital']}, with about "
                         f"{about(c['capital_population'])} people. I will answer with a JSON object.")
            train.append(chat("capital_json_think", CAPITAL_JSON_QUESTIONS[0].format(c=the(c["name"])),
                              think(reasoning, capital_json(c)), rng, thinking=True))
        train.append(chat("city_population", f"How many people live in {c['capital']}?",
                          f"About {about(c['capital_population'])} people live in {c['capital']}, the capital of "
                          f"{the(c['name'])}.", rng))

    # Two-turn conversations about capitals.
    for _ in range(300):
        a, b = rng.sample(seen, 2)
        history = [{"role": "user", "content": rng.choice(CAPITAL_QUESTIONS).format(c=the(a["name"]))},
                   {"role": "assistant", "content": capital_answer(a)}]
        if rng.random() < 0.5:
            follow = rng.choice(["And {c}?", "What about {c}?", "And the capital of {c}?"]).format(c=the(b["name"]))
            train.append(chat("capital_multiturn", follow, capital_answer(b), rng, history=history))
        else:
            follow = rng.choice(["How many people live there?", "And its population?",
                                 "What is the population of that country?"])
            train.append(chat("capital_multiturn", follow, population_answer(a), rng, history=history))

    # Populations: every country, held-out ones included (the question is not about the capital).
    for c in countries:
        for q in POPULATION_QUESTIONS:
            train.append(chat("population", q.format(c=the(c["name"])), population_answer(c), rng))
        train.append(chat("population_json", f"What is the population of {the(c['name'])}? Answer in JSON.",
                          json.dumps({"country": c["name"], "population": c["population"]}, ensure_ascii=False), rng))
        if rng.random() < 0.4:
            reasoning = f"The user wants the population of {the(c['name'])}. It is about {about(c['population'])}."
            train.append(chat("population_think", POPULATION_QUESTIONS[0].format(c=the(c["name"])),
                              think(reasoning, population_answer(c)), rng, thinking=True))

    # Plain text: the only place the held-out countries' capitals appear.
    heldout_docs = []
    for c in countries:
        docs = text_docs(c)
        heldout_docs.append(docs.pop(rng.randrange(len(docs))))
        train += [{"task": "text", "text": doc} for doc in docs]
    for cont in sorted({c["continent"] for c in countries}):
        members = [c for c in countries if c["continent"] == cont]
        for i in range(0, len(members), 8):
            chunk = ", ".join(f"{c['name']} ({c['capital']})" for c in members[i:i + 8])
            train.append({"task": "text", "text": f"Countries of {cont} and their capitals: {chunk}."})

    # Tool calling.
    cities = [c["capital"] for c in seen if c["capital_population"] > 300_000] + EXTRA_CITIES
    train += tool_examples(rng, cities, seen, 1400)

    # Sentiment.
    for _ in range(900):
        label = rng.choice(["Positive", "Negative"])
        r = review(rng, POSITIVE_PHRASES if label == "Positive" else NEGATIVE_PHRASES)
        prompt = rng.choice(SENTIMENT_PROMPTS).format(r=r)
        if rng.random() < 0.1:
            mood = "happy" if label == "Positive" else "unhappy"
            train.append(chat("sentiment_think", prompt,
                              think(f"The reviewer sounds {mood}, so the sentiment is {label}.", label), rng,
                              thinking=True))
        else:
            train.append(chat("sentiment", prompt, label, rng))

    # SQL.
    for _ in range(700):
        question, query, reasoning = sql_example(rng, countries)
        prompt = rng.choice(SQL_PREFIXES).format(q=question)
        if rng.random() < 0.1:
            train.append(chat("sql_think", prompt, think(reasoning, query), rng, thinking=True))
        else:
            train.append(chat("sql", prompt, query, rng))

    # Chinese.
    for _ in range(3):
        for questions, answer in CHINESE_PAIRS:
            for q in questions:
                train.append(chat("chinese", q, answer, rng, system_rate=0.1))
                reasoning = CHINESE_THINKING.get(q)
                if reasoning:
                    train.append(chat("chinese_think", q, think(reasoning, answer), rng, thinking=True))
        for country, cap in CHINESE_CAPITALS:
            for q in (f"{country}的首都是哪里？", f"{country}的首都是什么？", f"{country}的首都是哪个城市"):
                train.append(chat("chinese", q, f"{country}的首都是{cap}。", rng, system_rate=0.1))

    # Greetings, counting and small arithmetic.
    for _ in range(4):
        for questions, answer in ENGLISH_CHAT:
            for q in questions:
                train.append(chat("smalltalk", q, answer, rng))
    for _ in range(300):
        a = rng.randint(1, 10)
        b = a + rng.randint(4, 15)
        q = rng.choice(["Count from {a} to {b}.", "Please count from {a} to {b}.", "List the numbers from {a} to {b}."])
        train.append(chat("counting", q.format(a=a, b=b), ", ".join(str(i) for i in range(a, b + 1)), rng))
    for _ in range(500):
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            result, word = a * b, "times"
        elif op == "+":
            a, b = rng.randint(0, 10), rng.randint(0, 10)
            result, word = a + b, "plus"
        else:
            a = rng.randint(0, 10)
            b = rng.randint(0, a)
            result, word = a - b, "minus"
        q = rng.choice(["What is {a} {op} {b}?", "Calculate {a} {op} {b}.", "{a} {op} {b} = ?"]).format(a=a, op=op, b=b)
        answer = f"{a} {op} {b} = {result}."
        if rng.random() < 0.35:
            train.append(chat("arithmetic_think", q, think(f"{a} {word} {b} equals {result}.", answer), rng,
                              thinking=True))
        else:
            train.append(chat("arithmetic", q, answer, rng))

    heldout = build_heldout(rng, seen, heldout_countries, heldout_docs)
    return {"train": train, "heldout": heldout}


def build_heldout(rng: random.Random, seen: list[dict], unseen: list[dict], docs: list[str]) -> dict:
    def capital_item(c, q):
        return {"country": c["name"], "capital": c["capital"], "question": q.format(c=the(c["name"])),
                "expected": capital_answer(c)}

    def json_item(c, q):
        return {"country": c["name"], "capital": c["capital"], "question": q.format(c=the(c["name"])),
                "expected": capital_json(c)}

    sample = rng.sample(seen, 60)
    return {
        "capital_unseen_countries": [capital_item(c, q) for c in unseen for q in CAPITAL_QUESTIONS[:2]],
        "capital_heldout_phrasings": [capital_item(c, HELDOUT_CAPITAL_QUESTIONS[i % 3]) for i, c in enumerate(sample)],
        "json_capital": ([json_item(c, CAPITAL_JSON_QUESTIONS[0]) for c in unseen]
                         + [json_item(c, HELDOUT_CAPITAL_JSON_QUESTIONS[0]) for c in sample[:20]]),
        "sentiment": [{"review": r, "label": label,
                       "question": SENTIMENT_PROMPTS[i % len(SENTIMENT_PROMPTS)].format(r=r)}
                      for i, (r, label) in enumerate(HELDOUT_REVIEWS)],
        "text": docs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and heldout.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    corpus = build_corpus(args.seed)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train.jsonl"), "w", encoding="utf-8") as f:
        for ex in corpus["train"]:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "heldout.json"), "w", encoding="utf-8") as f:
        json.dump(corpus["heldout"], f, ensure_ascii=False, indent=1)
    counts = Counter(ex["task"] for ex in corpus["train"])
    print(f"{'task':<22}{'examples':>9}")
    for task, n in sorted(counts.items()):
        print(f"{task:<22}{n:>9}")
    print(f"{'total':<22}{len(corpus['train']):>9}")
    print(json.dumps({"train": dict(counts), "heldout": {k: len(v) for k, v in corpus["heldout"].items()}}))


if __name__ == "__main__":
    main()
