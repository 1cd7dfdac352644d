"""The environment: a SQLite database, a question, and four tools.

An episode is one `Task` (a question plus the gold SQL that answers it) and one `SQLEnv`. The
agent explores with `list_tables`, `describe_table` and `run_sql`, then ends the episode with
`submit_answer(query)`; the answer is right when its result matches the gold query's result
(`execution_match`, the rule of the Spider test-suite evaluator). Tool observations are short
plain text, because they are fed back to a small model with a short context.

    python sql_env.py          # a tour: the schema, sample questions per tier, split sizes

What is here, top to bottom:
1. The sandbox. Agent SQL is hostile input. `run_query` opens the file read-only (URI
   `mode=ro`, `PRAGMA query_only`), lets an authorizer callback allow only reads (no writes,
   DDL, ATTACH, transactions, state-changing PRAGMA, load_extension), relies on SQLite's
   compiler to refuse a second statement, stops runaway queries with a wall-clock progress
   handler, and caps value length, row count and result size. No regex looks at agent SQL.
2. Scoring. Results are compared as multisets (as lists when the gold SQL has ORDER BY),
   columns may come in any order, numbers are compared to 10 significant digits, NULL equals
   NULL, and a query that fails or times out is wrong. Gold results are cached.
3. The embedded data: a retailer (stores, employees, categories, products, customers, orders,
   order_items; ~4,500 rows) generated from a seed into `$AGENTRL_CACHE` (default
   ~/.cache/agentrl), and ~1,300 template questions in four tiers named after Spider's
   hardness levels. The test split is held out three ways: every template's last wording,
   every fourth value of each value domain (cities, products, years, prices, ...) and a few
   whole templates that combine skills seen separately in train are used only in test.
   Every gold query is run when the set is generated (under a second) and kept only if its
   answer is non-empty, short, and the same whichever way ties are broken.
4. `SQLEnv`, the episode, and loaders for Spider and BIRD folders.

Simplifications, and why they are safe: the question set is templated, so its language is
narrow (it is a teaching set, not a benchmark: use Spider or BIRD for claims); whether order
matters is decided by "ORDER BY" appearing anywhere in the gold SQL, as Spider's evaluator
does; the tiers of Spider/BIRD questions without a label are estimated from the gold SQL.
"""
import functools
import itertools
import json
import os
import random
import re
import sqlite3
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass
from datetime import date
from pathlib import Path

TIERS = ("easy", "medium", "hard", "extra")  # Spider's hardness levels, easiest first
SPLITS = ("train", "test")
MAX_VALUE_BYTES = 100_000       # longest string or blob SQLite may build (SQLITE_LIMIT_LENGTH)
MAX_RESULT_BYTES = 1_000_000    # largest result run_query returns
SCORE_MAX_ROWS = 100_000        # row cap when scoring: large enough for any real gold result
SCORE_MAX_BYTES = 10_000_000
GOLD_TIMEOUT_S = 30.0           # gold SQL is trusted but may be slow (BIRD)


class SQLError(Exception):
    """A query was refused, failed, or ran past a limit. The message is meant for the agent."""


class ToolError(Exception):
    """A tool was called wrongly (unknown name, bad arguments). The message is meant for the agent."""


@dataclass
class Task:
    id: str
    db_path: str
    question: str
    gold_sql: str
    evidence: str = ""              # a hint that comes with the question (BIRD), "" if none
    difficulty: str = "easy"        # one of TIERS
    split: str = "train"


# ----------------------------------------------------------------------------- 1. the sandbox
_READ_ONLY_PRAGMAS = {"table_info", "table_xinfo", "index_list", "index_info", "foreign_key_list"}
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}


def _connect(db_path):
    """A read-only connection: the file is opened with mode=ro, and query_only is set on top."""
    if not os.path.isfile(db_path):
        raise SQLError(f"no database file at {db_path}")
    con = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        con.execute("PRAGMA query_only = ON")
    except sqlite3.Error as e:
        con.close()
        raise SQLError(f"cannot open the database {db_path}: {e}") from None
    return con


def run_query(db_path, sql, timeout_s=2.0, max_rows=1000, max_bytes=MAX_RESULT_BYTES):
    """Run one read-only statement in the sandbox; return (column names, rows) or raise SQLError.

    A result over `max_rows` rows or `max_bytes` bytes is an error, never silently truncated:
    a cut result scored against the gold would look wrong (or right) for the wrong reason."""
    if not isinstance(sql, str) or not sql.strip():
        raise SQLError("the query is empty")
    con = _connect(db_path)
    refused = []  # what the authorizer turned down, for the error message

    def authorize(action, arg1, arg2, db_name, trigger):
        if (action in _ALLOWED
                or (action == sqlite3.SQLITE_FUNCTION and arg2.lower() != "load_extension")
                or (action == sqlite3.SQLITE_PRAGMA and arg1.lower() in _READ_ONLY_PRAGMAS)):
            return sqlite3.SQLITE_OK
        refused.append(action)
        return sqlite3.SQLITE_DENY

    con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)  # e.g. zeroblob(10**9) fails early
    con.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
    con.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    con.set_authorizer(authorize)
    deadline = time.monotonic() + timeout_s
    # SQLite calls this every 1000 virtual-machine instructions; a true value interrupts the
    # query, so a recursive CTE without end or a huge cross join stops at the deadline.
    con.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
    try:
        cursor = con.execute(sql)  # compiles one statement; anything left after it is refused
        if cursor.description is None:
            raise SQLError("not a query: only a single read-only SELECT statement is allowed")
        rows, size = [], 0
        while batch := cursor.fetchmany(256):
            rows += batch
            size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for row in batch for v in row)
            if len(rows) > max_rows:
                raise SQLError(f"the result has more than {max_rows} rows; add a LIMIT or aggregate")
            if size > max_bytes:
                raise SQLError(f"the result is larger than {max_bytes} bytes")
        return [d[0] for d in cursor.description], rows
    except (sqlite3.Error, sqlite3.Warning, UnicodeError) as e:  # UnicodeError: unencodable text
        if time.monotonic() > deadline:
            raise SQLError(f"the query ran longer than {timeout_s:g} s and was stopped") from None
        if refused:
            raise SQLError("not allowed: only a read-only SELECT may run (no writes, schema changes, "
                           "ATTACH, transactions or PRAGMA settings)") from None
        raise SQLError(str(e)) from None
    finally:
        con.close()


# ----------------------------------------------------------------------------- 2. scoring
def _canonical(value):
    """A hashable form under which equal answers are equal: 3 == 3.0, floats to 10 digits."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**53 else float(f"{value:.10g}")
    return value


def _results_match(gold, pred, ordered):
    """Spider test-suite equality of two row lists, allowing the columns in any order."""
    if len(gold) != len(pred) or (gold and len(gold[0]) != len(pred[0])):
        return False
    if not gold:
        return True
    gold_cols, pred_cols = [Counter(c) for c in zip(*gold)], [Counter(c) for c in zip(*pred)]
    # Each gold column may be matched by any predicted column holding the same multiset of values.
    options = [[j for j, p in enumerate(pred_cols) if p == g] for g in gold_cols]
    for perm in itertools.product(*options):
        if len(set(perm)) < len(perm):
            continue
        rows = [tuple(row[j] for j in perm) for row in pred]
        if (rows == gold) if ordered else (Counter(rows) == Counter(gold)):
            return True
    return False


def _file_stamp(path):
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size  # a rebuilt database invalidates its cached results


@functools.lru_cache(maxsize=65536)
def _gold_rows(db_path, gold_sql, stamp):
    try:
        rows = run_query(db_path, gold_sql, GOLD_TIMEOUT_S, SCORE_MAX_ROWS, SCORE_MAX_BYTES)[1]
    except SQLError as e:
        raise SQLError(f"the gold query failed on {db_path}: {e}\n{gold_sql}") from None
    return [tuple(map(_canonical, row)) for row in rows]


def execution_match(db_path, pred_sql, gold_sql, timeout_s=2.0):
    """True when pred_sql returns the same result as gold_sql. Raises SQLError only if the gold fails."""
    gold = _gold_rows(db_path, gold_sql, _file_stamp(db_path))
    try:  # more rows than the gold is wrong anyway: cap there, so a huge result costs nothing
        pred = run_query(db_path, pred_sql, timeout_s, len(gold), SCORE_MAX_BYTES)[1]
    except SQLError:
        return False
    pred = [tuple(map(_canonical, row)) for row in pred]
    return _results_match(gold, pred, ordered="order by" in gold_sql.lower())  # Spider's rule


# ----------------------------------------------------------------------------- 3. embedded data
SCHEMA = """
CREATE TABLE stores (store_id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL,
  country TEXT NOT NULL, opened_on DATE NOT NULL);
CREATE TABLE employees (employee_id INTEGER PRIMARY KEY, first_name TEXT NOT NULL,
  last_name TEXT NOT NULL, role TEXT NOT NULL, store_id INTEGER NOT NULL REFERENCES stores(store_id),
  salary REAL NOT NULL, hired_on DATE NOT NULL);
CREATE TABLE categories (category_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE products (product_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
  category_id INTEGER NOT NULL REFERENCES categories(category_id), price REAL NOT NULL,
  stock INTEGER NOT NULL, discontinued_on DATE);
CREATE TABLE customers (customer_id INTEGER PRIMARY KEY, first_name TEXT NOT NULL,
  last_name TEXT NOT NULL, email TEXT, city TEXT NOT NULL, country TEXT NOT NULL,
  joined_on DATE NOT NULL);
CREATE TABLE orders (order_id INTEGER PRIMARY KEY,
  customer_id INTEGER NOT NULL REFERENCES customers(customer_id),
  store_id INTEGER NOT NULL REFERENCES stores(store_id),
  employee_id INTEGER REFERENCES employees(employee_id), order_date DATE NOT NULL,
  status TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(order_id),
  product_id INTEGER NOT NULL REFERENCES products(product_id), quantity INTEGER NOT NULL,
  unit_price REAL NOT NULL, PRIMARY KEY (order_id, product_id));
"""
COUNTRIES = {"Belgium": ["Antwerp", "Brussels"], "France": ["Lyon", "Marseille", "Paris"],
             "Germany": ["Berlin", "Hamburg", "Munich"], "Italy": ["Milan", "Rome", "Turin"],
             "Netherlands": ["Amsterdam", "Rotterdam"], "Portugal": ["Lisbon", "Porto"],
             "Spain": ["Barcelona", "Madrid", "Valencia"]}
CATEGORIES = {  # name: (price range, product nouns)
    "Beauty": ((4, 60), ["Shampoo", "Face Cream", "Perfume", "Lip Balm", "Hair Dryer"]),
    "Books": ((8, 40), ["Atlas", "Cookbook", "Novel", "Journal", "Biography"]),
    "Clothing": ((15, 120), ["Jacket", "Scarf", "Sweater", "Raincoat", "Hoodie"]),
    "Electronics": ((20, 400), ["Headphones", "Speaker", "Charger", "Webcam", "Keyboard"]),
    "Garden": ((5, 150), ["Hose", "Planter", "Rake", "Lantern", "Bird Feeder"]),
    "Grocery": ((2, 30), ["Coffee", "Olive Oil", "Honey", "Tea", "Pasta"]),
    "Kitchen": ((10, 200), ["Kettle", "Blender", "Frying Pan", "Knife Set", "Toaster"]),
    "Music": ((10, 350), ["Guitar", "Ukulele", "Metronome", "Drum Pad", "Vinyl Record"]),
    "Office": ((3, 250), ["Desk Lamp", "Notebook", "Stapler", "Office Chair", "Pen Set"]),
    "Pets": ((3, 80), ["Dog Bed", "Cat Toy", "Leash", "Aquarium", "Bird Cage"]),
    "Sports": ((10, 300), ["Yoga Mat", "Football", "Tennis Racket", "Water Bottle", "Dumbbells"]),
    "Toys": ((5, 90), ["Puzzle", "Kite", "Robot", "Board Game", "Teddy Bear"]),
}
ADJECTIVES = ["Classic", "Compact", "Deluxe", "Eco", "Premium", "Smart", "Travel", "Vintage"]
FIRST_NAMES = ("Anna Ben Chloe David Elena Farid Grace Hugo Ines Jonas Karim Lea Marco Nina Omar "
               "Paula Quentin Rosa Sven Tara Umar Vera Willem Xenia Yusuf Zoe Alba Bruno Clara Dario").split()
LAST_NAMES = ("Adler Bianchi Costa Dubois Eriksen Fischer Garcia Hansen Ivanov Jansen Keller Laurent "
              "Moreau Novak Olsen Peeters Rossi Silva Torres Urban Vogel Weber Young Zimmer Barros "
              "Conti Dekker Ferreira Lopez Martin").split()
SALARIES = {"manager": 52000, "sales associate": 31000, "cashier": 26000, "stock clerk": 24000}
STATUSES = {"delivered": 60, "shipped": 14, "pending": 8, "cancelled": 11, "returned": 7}  # weights


@functools.lru_cache(maxsize=4)
def _retail_rows(seed):
    """Every row of the embedded database as {table: [tuple, ...]}, deterministic in `seed`."""
    rng = random.Random(seed)

    def day(lo, hi):  # a uniform random date between two ISO dates, as ISO text
        lo, hi = date.fromisoformat(lo).toordinal(), date.fromisoformat(hi).toordinal()
        return date.fromordinal(rng.randint(lo, hi)).isoformat()

    stores, employees = [], []
    for country, cities in COUNTRIES.items():
        for city in cities:
            sid = len(stores) + 1
            suffix = rng.choice(["Central", "Market", "Plaza", "Station"])
            stores.append((sid, f"{city} {suffix}", city, country, day("2010-01-01", "2020-12-31")))
            for role in ["manager"] + rng.choices(list(SALARIES)[1:], k=rng.randint(2, 5)):
                employees.append((len(employees) + 1, rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES), role,
                                  sid, round(SALARIES[role] * rng.uniform(0.85, 1.3), 2),
                                  day("2012-01-01", "2024-06-30")))
    categories = [(i + 1, name) for i, name in enumerate(CATEGORIES)]
    products = []
    for cid, ((lo, hi), nouns) in enumerate(CATEGORIES.values(), start=1):
        for name in rng.sample([f"{a} {n}" for a in ADJECTIVES for n in nouns], 8):
            products.append((len(products) + 1, name, cid, round(rng.uniform(lo, hi), 2), rng.randint(0, 300),
                             day("2021-01-01", "2024-12-31") if rng.random() < 0.15 else None))
    city_country = {city: country for country, cities in COUNTRIES.items() for city in cities}
    customers = []
    for first, last in rng.sample([(f, l) for f in FIRST_NAMES for l in LAST_NAMES], 300):
        city = rng.choice(list(city_country))
        email = None if rng.random() < 0.15 else f"{first}.{last}@example.com".lower()
        customers.append((len(customers) + 1, first, last, email, city, city_country[city],
                          day("2019-01-01", "2024-12-31")))
    orders, items = [], []
    for customer in rng.sample(customers, 250):  # the other 50 customers never order
        for _ in range(rng.randint(1, 8)):
            store = rng.choice([s for s in stores if s[3] == customer[5]])
            staff = [e[0] for e in employees if e[4] == store[0]]
            oid = len(orders) + 1
            orders.append((oid, customer[0], store[0], None if rng.random() < 0.2 else rng.choice(staff),
                           day(max(customer[6], "2021-01-01"), "2024-12-31"),
                           rng.choices(list(STATUSES), weights=list(STATUSES.values()))[0]))
            for product in rng.sample(products, rng.randint(1, 4)):
                discount = rng.choice([1.0, 1.0, 1.0, 0.9, 0.8])
                items.append((oid, product[0], rng.randint(1, 5), round(product[3] * discount, 2)))
    return {"stores": stores, "employees": employees, "categories": categories, "products": products,
            "customers": customers, "orders": orders, "order_items": items}


def build_database(path, seed=0):
    """Write the embedded database to `path` atomically (temp file + rename); same seed, same bytes."""
    tmp = f"{path}.{os.getpid()}.tmp"  # one writer per process; os.replace makes the swap atomic
    if os.path.exists(tmp):
        os.remove(tmp)  # left by a killed run
    try:
        with closing(sqlite3.connect(tmp)) as con:
            con.executescript(SCHEMA)
            for table, rows in _retail_rows(seed).items():
                con.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
            con.commit()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def cache_dir():
    """Where generated files live: $AGENTRL_CACHE, else ~/.cache/agentrl."""
    path = Path(os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl")
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_db_path(seed=0):
    """The embedded database's path; built on first use, and rebuilt if missing or corrupt."""
    path = str(cache_dir() / f"retail-v1-seed{seed}.sqlite")
    try:
        with closing(_connect(path)) as con:
            intact = (con.execute("PRAGMA quick_check").fetchone() == ("ok",) and
                      con.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone() == (7,))
    except (SQLError, sqlite3.Error):
        intact = False
    return path if intact else build_database(path, seed)


# Question templates: (tier, value domains, gold SQL, wordings separated by " | "). The LAST wording of
# each is kept for the test split. Tiers follow Spider: easy = one table; medium = an aggregate, a join or
# two conditions; hard = GROUP BY / ORDER BY / LIMIT / HAVING; extra = a nested query or two joins.
_CAT = "FROM products AS p JOIN categories AS c ON p.category_id = c.category_id"
_ITEMS = "FROM orders AS o JOIN order_items AS i ON o.order_id = i.order_id"
_WHO = "WHERE c.first_name = '{first}' AND c.last_name = '{last}'"
_REVENUE = "SUM(i.quantity * i.unit_price)"
TEMPLATES = [
    ("easy", "city", "SELECT COUNT(*) FROM customers WHERE city = '{city}'",
     "How many customers live in {city}? | Count the customers based in {city}. | What is the number of "
     "customers whose city is {city}?"),
    ("easy", "product", "SELECT price FROM products WHERE name = '{product}'",
     "What is the price of the {product}? | How much does the {product} cost? | Give the price of the {product}."),
    ("easy", "product", "SELECT stock FROM products WHERE name = '{product}'",
     "How many units of the {product} are in stock? | What is the stock level of the {product}? | "
     "How many {product} units do we have in stock?"),
    ("easy", "price", "SELECT COUNT(*) FROM products WHERE price > {price}",
     "How many products cost more than ${price}? | Count the products priced above {price} dollars. | "
     "What is the number of products with a price over ${price}?"),
    ("easy", "year", "SELECT COUNT(*) FROM customers WHERE strftime('%Y', joined_on) = '{year}'",
     "How many customers joined in {year}? | Count the customers who signed up in {year}. | "
     "How many new customers did we get in {year}?"),
    ("easy", "month", "SELECT COUNT(*) FROM orders WHERE strftime('%Y-%m', order_date) = '{month}'",
     "How many orders were placed in {month_name}? | Count the orders made in {month_name}. | "
     "What is the number of orders from {month_name}?"),
    ("easy", "customer", "SELECT email FROM customers AS c " + _WHO,
     "What is the email address of {first} {last}? | Give the email of the customer {first} {last}. | "
     "Which email address does customer {first} {last} use?"),
    ("easy", "customer", "SELECT city FROM customers AS c " + _WHO,
     "Which city does {first} {last} live in? | In what city is the customer {first} {last} based? | "
     "Where does customer {first} {last} live?"),
    ("medium", "category", f"SELECT AVG(p.price) {_CAT} WHERE c.name = '{{category}}'",
     "What is the average price of products in the {category} category? | What do {category} products cost "
     "on average? | Give the mean price of the {category} products."),
    ("medium", "category", f"SELECT COUNT(*) {_CAT} WHERE c.name = '{{category}}'",
     "How many products are in the {category} category? | Count the {category} products. | "
     "What is the number of products in category {category}?"),
    ("medium", "category price", f"SELECT p.name {_CAT} WHERE c.name = '{{category}}' AND p.price < {{price}}",
     "Which {category} products cost less than ${price}? | List the {category} products priced under {price} "
     "dollars. | Name the products in the {category} category that are cheaper than ${price}."),
    ("medium", "role", "SELECT MAX(salary) FROM employees WHERE role = '{role}'",
     "What is the highest salary of any {role}? | How much does the best-paid {role} earn? | "
     "Give the maximum salary among employees with the role {role}."),
    ("medium", "country", "SELECT AVG(e.salary) FROM employees AS e JOIN stores AS s ON e.store_id = s.store_id "
     "WHERE s.country = '{country}'",
     "What is the average salary of employees working in {country}? | How much do our employees in {country} "
     "earn on average? | Give the mean salary of staff at stores in {country}."),
    ("medium", "city", "SELECT COUNT(*) FROM customers WHERE city = '{city}' AND email IS NULL",
     "How many customers in {city} have no email address? | Count the customers from {city} without an "
     "email. | How many {city} customers are missing an email address?"),
    ("medium", "city year", "SELECT COUNT(*) FROM customers WHERE city = '{city}' AND strftime('%Y', joined_on) "
     "= '{year}'",
     "How many customers from {city} joined in {year}? | Count the customers in {city} who signed up in "
     "{year}. | In {year}, how many new customers came from {city}?"),
    ("medium", "status month", "SELECT COUNT(*) FROM orders WHERE status = '{status}' AND strftime('%Y-%m', "
     "order_date) = '{month}'",
     "How many orders from {month_name} have the status {status}? | Count the {status} orders placed in "
     "{month_name}. | Of the orders made in {month_name}, how many are {status}?"),
    ("medium", "city", "SELECT COUNT(*) FROM orders AS o JOIN stores AS s ON o.store_id = s.store_id "
     "WHERE s.city = '{city}'",
     "How many orders were placed at the store in {city}? | Count the orders of our {city} store. | "
     "What is the number of orders handled by the {city} store?"),
    ("medium", "city", "SELECT e.first_name, e.last_name FROM employees AS e JOIN stores AS s ON e.store_id = "
     "s.store_id WHERE s.city = '{city}'",
     "Who works at the store in {city}? Give first and last names. | List the names of the employees of the "
     "{city} store. | Give the first and last name of every employee at our {city} store."),
    ("medium", "product", "SELECT COUNT(*) FROM order_items AS i JOIN products AS p ON i.product_id = "
     "p.product_id WHERE p.name = '{product}'",
     "How many orders include the {product}? | In how many orders was the {product} bought? | "
     "Count the orders containing the {product}."),
    ("hard", "category", f"SELECT p.name {_CAT} WHERE c.name = '{{category}}' ORDER BY p.price DESC LIMIT 1",
     "What is the most expensive product in the {category} category? | Which {category} product has the "
     "highest price? | Name the priciest {category} product."),
    ("hard", "category", f"SELECT p.name {_CAT} WHERE c.name = '{{category}}' ORDER BY p.price LIMIT 3",
     "List the three cheapest {category} products, cheapest first. | What are the 3 lowest-priced {category} "
     "products, from the cheapest? | Give the three least expensive {category} products in order of price."),
    ("hard", "month", "SELECT status, COUNT(*) FROM orders WHERE strftime('%Y-%m', order_date) = '{month}' "
     "GROUP BY status",
     "For each status, how many orders were placed in {month_name}? | Count the orders of {month_name} per "
     "status. | Give every order status with its number of orders in {month_name}."),
    ("hard", "price", f"SELECT c.name, COUNT(*) {_CAT} WHERE p.price > {{price}} GROUP BY c.name",
     "For each category, how many products cost more than ${price}? | Count the products priced above "
     "{price} dollars in every category. | Per category, give the number of products with a price over ${price}."),
    ("hard", "price", f"SELECT c.name {_CAT} GROUP BY c.name HAVING AVG(p.price) > {{price}}",
     "Which categories have an average product price above ${price}? | List the categories whose products "
     "cost more than {price} dollars on average. | Name the categories with a mean price greater than ${price}."),
    ("hard", "salary", "SELECT role, COUNT(*) FROM employees WHERE salary > {salary} GROUP BY role",
     "For each role, how many employees earn more than {salary}? | Count the employees with a salary above "
     "{salary} per role. | Per role, give the number of staff members paid over {salary}."),
    ("hard", "city", "SELECT e.first_name, e.last_name FROM employees AS e JOIN stores AS s ON e.store_id = "
     "s.store_id WHERE s.city = '{city}' ORDER BY e.salary DESC LIMIT 1",
     "Who is the best-paid employee at the {city} store? | Which employee of the {city} store has the "
     "highest salary? | Name the employee with the top salary at our store in {city}."),
    ("hard", "country", "SELECT city FROM customers WHERE country = '{country}' GROUP BY city "
     "ORDER BY COUNT(*) DESC LIMIT 1",
     "Which city in {country} has the most customers? | In {country}, which city do most of our customers "
     "live in? | Name the city of {country} with the largest number of customers."),
    ("hard", "customer", "SELECT o.order_date FROM orders AS o JOIN customers AS c ON o.customer_id = "
     f"c.customer_id {_WHO} ORDER BY o.order_date DESC LIMIT 1",
     "When did {first} {last} place their most recent order? | What is the date of the latest order by "
     "{first} {last}? | On which day did customer {first} {last} last order?"),
    ("extra", "category", f"SELECT p.name {_CAT} WHERE c.name = '{{category}}' AND p.price > "
     "(SELECT AVG(price) FROM products)",
     "Which {category} products cost more than the average product? | List the {category} products priced "
     "above the average price of all products. | Name the {category} products dearer than the overall average."),
    ("extra", "city", "SELECT first_name, last_name FROM customers WHERE city = '{city}' AND customer_id "
     "NOT IN (SELECT customer_id FROM orders)",
     "Which customers in {city} have never placed an order? | List the customers from {city} without any "
     "orders. | Give the names of {city} customers who have not ordered anything."),
    ("extra", "city year", f"SELECT {_REVENUE} {_ITEMS} JOIN stores AS s ON o.store_id = s.store_id "
     "WHERE s.city = '{city}' AND strftime('%Y', o.order_date) = '{year}'",
     "What was the total revenue of the {city} store in {year}? | How much did the {city} store sell in "
     "{year}, in money? | Give the {year} sales revenue of our store in {city}."),
    ("extra", "category", f"SELECT p.name {_CAT} JOIN order_items AS i ON i.product_id = p.product_id "
     "WHERE c.name = '{category}' GROUP BY p.product_id ORDER BY SUM(i.quantity) DESC LIMIT 1",
     "Which {category} product has sold the most units? | What is the best-selling {category} product by "
     "quantity? | Name the {category} product with the largest number of units sold."),
    ("extra", "category year", f"SELECT COUNT(DISTINCT o.customer_id) {_ITEMS} JOIN products AS p ON "
     "i.product_id = p.product_id JOIN categories AS c ON p.category_id = c.category_id "
     "WHERE c.name = '{category}' AND strftime('%Y', o.order_date) = '{year}'",
     "How many different customers bought {category} products in {year}? | Count the distinct customers who "
     "ordered {category} items in {year}. | In {year}, how many customers bought from the {category} category?"),
    ("extra", "city", f"SELECT c.first_name, c.last_name {_ITEMS} JOIN customers AS c ON o.customer_id = "
     f"c.customer_id WHERE c.city = '{{city}}' GROUP BY c.customer_id ORDER BY {_REVENUE} DESC LIMIT 1",
     "Which customer from {city} has spent the most money? | Who is the biggest spender among our {city} "
     "customers? | Name the {city} customer with the highest total spending."),
    ("extra", "customer", f"SELECT {_REVENUE} {_ITEMS} JOIN customers AS c ON o.customer_id = c.customer_id "
     + _WHO,
     "How much has {first} {last} spent in total? | What is the total amount of all orders by {first} "
     "{last}? | Give the total spending of customer {first} {last}."),
    ("extra", "product", f"SELECT COUNT(DISTINCT o.customer_id) {_ITEMS} JOIN products AS p ON i.product_id = "
     "p.product_id WHERE p.name = '{product}'",
     "How many different customers have bought the {product}? | Count the distinct customers who ordered "
     "the {product}. | By how many customers was the {product} purchased?"),
]
# Whole templates used only in test: new combinations of skills that train teaches separately.
HELD_OUT_TEMPLATES = [
    ("easy", "city", "SELECT first_name, last_name FROM customers WHERE city = '{city}' AND email IS NULL",
     "Which customers in {city} have no email address? Give their names."),
    ("medium", "city month", "SELECT COUNT(*) FROM orders AS o JOIN stores AS s ON o.store_id = s.store_id "
     "WHERE s.city = '{city}' AND strftime('%Y-%m', o.order_date) = '{month}'",
     "How many orders did the {city} store receive in {month_name}?"),
    ("hard", "category price", f"SELECT p.name {_CAT} WHERE c.name = '{{category}}' AND p.price < {{price}} "
     "ORDER BY p.price DESC LIMIT 1",
     "What is the most expensive {category} product that costs less than ${price}?"),
    ("extra", "product year", f"SELECT {_REVENUE} {_ITEMS} JOIN products AS p ON i.product_id = p.product_id "
     "WHERE p.name = '{product}' AND strftime('%Y', o.order_date) = '{year}'",
     "How much revenue did the {product} bring in {year}?"),
]
PER_TEMPLATE = {"train": 60, "test": 10}  # most questions one template may contribute to a split

_MONTHS = "January February March April May June July August September October November December".split()


def _domains(seed):
    """Each value domain as {split: [slot values]}; every fourth value is kept for test."""
    rows = _retail_rows(seed)
    domains = {
        "city": [{"city": c} for c in sorted(c for cities in COUNTRIES.values() for c in cities)],
        "country": [{"country": c} for c in sorted(COUNTRIES)],
        "category": [{"category": c} for c in sorted(CATEGORIES)],
        "product": [{"product": name} for name in sorted(p[1] for p in rows["products"])],
        "customer": [{"first": f, "last": l} for f, l in sorted(c[1:3] for c in rows["customers"])],
        "year": [{"year": str(y)} for y in range(2021, 2025)],
        "month": [{"month": f"{y}-{m:02d}", "month_name": f"{_MONTHS[m - 1]} {y}"}
                  for y in range(2021, 2025) for m in range(1, 13)],
        "status": [{"status": s} for s in sorted(STATUSES)],
        "role": [{"role": r} for r in sorted(SALARIES)],
        "price": [{"price": p} for p in range(5, 300, 5)],
        "salary": [{"salary": s} for s in range(24000, 70000, 2000)],
    }
    return {name: {"train": [v for i, v in enumerate(vals) if i % 4 != 3], "test": vals[3::4]}
            for name, vals in domains.items()}


def _is_clear(con, sql):
    """A gold query is kept only if its answer is non-empty, short, not all 0/NULL, and unambiguous."""
    rows = con.execute(sql).fetchall()
    if not rows or len(rows) > 30 or any(all(v in (None, 0) for v in row) for row in rows):
        return False
    ordered = re.fullmatch(r"(.* ORDER BY .+?)( LIMIT \d+)?", sql)  # our own template SQL, not agent SQL
    if ordered is None:
        return True
    # Break ties both ways on every output column: if the answer changes, it depended on ties.
    head, limit, cols = ordered.group(1), ordered.group(2) or "", range(1, len(rows[0]) + 1)
    ascending = con.execute(f"{head}, {', '.join(f'{c} ASC' for c in cols)}{limit}").fetchall()
    descending = con.execute(f"{head}, {', '.join(f'{c} DESC' for c in cols)}{limit}").fetchall()
    return ascending == descending


@functools.lru_cache(maxsize=4)
def _embedded_tasks(seed, db):
    """{split: [Task]}: each template filled with its split's values and wordings, then validated."""
    con, domains, tasks = _connect(db), _domains(seed), {}
    for split in SPLITS:
        templates = TEMPLATES + (HELD_OUT_TEMPLATES if split == "test" else [])
        out = []
        for k, (tier, slots, sql, wordings) in enumerate(templates):
            rng, wordings = random.Random(f"{seed}/{split}/{k}"), wordings.split(" | ")
            if k < len(TEMPLATES):  # a shared template: train gets all wordings but the last
                wordings = wordings[:-1] if split == "train" else wordings[-1:]
            combos = list(itertools.product(*(domains[d][split] for d in slots.split())))
            rng.shuffle(combos)
            kept = 0
            for combo in combos:
                values = {key: v for part in combo for key, v in part.items()}
                gold = sql.format(**values)
                if _is_clear(con, gold):
                    question = rng.choice(wordings).format(**values)
                    out.append(Task("", db, question, gold, difficulty=tier, split=split))
                    kept += 1
                    if kept == PER_TEMPLATE[split]:
                        break
        random.Random(f"{seed}/{split}").shuffle(out)
        for i, task in enumerate(out):
            task.id = f"retail-{split}-{i:04d}"
        tasks[split] = out
    con.close()
    return tasks


# ----------------------------------------------------------------------------- 4. the episode
def _tool(name, description, **args):
    properties = {arg: {"type": "string", "description": text} for arg, text in args.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters":
            {"type": "object", "properties": properties, "required": list(args)}}}


TOOLS = [
    _tool("list_tables", "List the tables of the database and their columns."),
    _tool("describe_table", "Show one table's columns, types, keys and 3 sample rows.", table="the table name"),
    _tool("run_sql", "Run one read-only SQLite SELECT query and see its result.", query="the SQL query"),
    _tool("submit_answer", "Submit the SQL query that answers the question. This ends the episode.",
          query="the final SQL query"),
]
_TOOL_ARGS = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}


def _quote(name):
    return '"' + name.replace('"', '""') + '"'


def _cell(value):
    text = ("NULL" if value is None else str(round(value, 4)) if isinstance(value, float)
            else f"<{len(value)} bytes>" if isinstance(value, bytes) else str(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _format_rows(columns, rows, max_rows):
    """A result as a small pipe-separated table that says when rows were left out."""
    lines = [" | ".join(columns)] + [" | ".join(map(_cell, row)) for row in rows[:max_rows]]
    if len(rows) > max_rows:
        lines.append(f"... ({len(rows)} rows, showing the first {max_rows})")
    else:
        lines.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
    return "\n".join(lines)


class SQLEnv:
    """One episode: a task, the tools, and the outcome. `call` never raises on agent mistakes."""

    tools = TOOLS

    def __init__(self, task, max_rows=20, max_chars=1500, timeout_s=2.0):
        self.task, self.max_rows, self.max_chars, self.timeout_s = task, max_rows, max_chars, timeout_s
        self.done, self.submitted_sql, self.correct = False, None, False
        self.num_tool_calls = self.num_tool_errors = 0
        self.gold_error = None  # set if the task's own gold SQL failed: a data bug, not an agent error

    def call(self, name, arguments):
        """Run tool `name` with `arguments` (a dict) and return the observation text."""
        self.num_tool_calls += 1
        try:
            text = self._dispatch(name, arguments)
        except (ToolError, SQLError) as e:
            self.num_tool_errors += 1
            text = f"Error: {e}"
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"\n... (truncated to {self.max_chars} characters)"
        return text

    def _dispatch(self, name, arguments):
        if self.done:
            raise ToolError("the answer was already submitted; the episode is over")
        if not isinstance(name, str) or name not in _TOOL_ARGS:
            raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(_TOOL_ARGS)}")
        arguments = {} if arguments is None else arguments
        usage = f"{name} takes " + (", ".join(f'"{a}" (a string)' for a in _TOOL_ARGS[name]) or "no arguments")
        if not isinstance(arguments, dict) or set(arguments) != set(_TOOL_ARGS[name]):
            raise ToolError(f"{usage}, got {json.dumps(arguments, default=str)[:200]}")
        if not all(isinstance(v, str) for v in arguments.values()):
            raise ToolError(usage)
        return getattr(self, "_" + name)(**arguments)

    def _query(self, sql, max_rows=1000):
        return run_query(self.task.db_path, sql, self.timeout_s, max_rows)

    def _tables(self):
        sql = "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
        return [row[0] for row in self._query(sql)[1]]

    def _list_tables(self):
        return "\n".join(f"{t}: " + ", ".join(col[1] for col in self._query(f"PRAGMA table_info({_quote(t)})")[1])
                         for t in self._tables())

    def _describe_table(self, table):
        by_name = {t.lower(): t for t in self._tables()}
        t = by_name.get(table.strip().strip('"`[]').lower())
        if t is None:
            raise ToolError(f"no table named {table!r}; the tables are {', '.join(by_name.values())}")
        refs = {fk[3]: f"{fk[2]}.{fk[4]}" if fk[4] else fk[2]
                for fk in self._query(f"PRAGMA foreign_key_list({_quote(t)})")[1]}
        lines = [f"table {t} ({self._query(f'SELECT COUNT(*) FROM {_quote(t)}')[1][0][0]} rows)"]
        for _, column, type_, _, _, pk in self._query(f"PRAGMA table_info({_quote(t)})")[1]:
            lines.append(f"  {column} {type_ or 'ANY'}" + (" primary key" if pk else "")
                         + (f" -> {refs[column]}" if column in refs else ""))
        columns, rows = self._query(f"SELECT * FROM {_quote(t)} LIMIT 3")
        return "\n".join(lines) + "\nsample rows:\n" + _format_rows(columns, rows, 3)

    def _run_sql(self, query):
        return _format_rows(*self._query(query), self.max_rows)

    def _submit_answer(self, query):
        self.done, self.submitted_sql = True, query
        try:
            self.correct = execution_match(self.task.db_path, query, self.task.gold_sql, self.timeout_s)
        except SQLError as e:
            self.gold_error = str(e)
        return "Answer submitted."


# ----------------------------------------------------------------------------- loaders
SPIDER_FILES = {"train": ("train_spider.json", "database"), "dev": ("dev.json", "database"),
                "test": ("test.json", "test_database")}
BIRD_FILES = {"train": ("train.json", "train_databases"), "dev": ("dev.json", "dev_databases")}
BIRD_TIERS = {"simple": "easy", "moderate": "medium", "challenging": "hard"}


def _estimate_tier(sql):
    """Spider-like hardness from the gold SQL's shape, for questions that come without a tier."""
    s = " ".join(sql.lower().split())
    if s.count("select") > 1 or s.count(" join ") > 1:
        return "extra"
    if any(k in s for k in ("group by", "order by", "having", " limit ")):
        return "hard"
    if re.search(r" join | and | or |\b(count|sum|avg|min|max) ?\(", s):
        return "medium"
    return "easy"


def _load(root, files, split, sql_key, name):
    if split not in files:
        raise ValueError(f"{name} has splits {', '.join(files)}, not {split!r}")
    root = Path(root)
    path, db_folder = root / files[split][0], root / files[split][1]
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: malformed JSON in {path}: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{name}: {path} must hold a JSON list of questions")
    keys, tasks = ("db_id", "question", sql_key), []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in keys):
            raise ValueError(f"{name}: entry {i} of {path} lacks a string {', '.join(keys)}")
        db = db_folder / entry["db_id"] / f"{entry['db_id']}.sqlite"
        if not db.is_file():
            raise FileNotFoundError(f"{name}: missing database {db} (entry {i} of {path})")
        tier = BIRD_TIERS.get(entry.get("difficulty")) or _estimate_tier(entry[sql_key])
        tasks.append(Task(f"{name.lower()}-{split}-{i:05d}", str(db), entry["question"], entry[sql_key],
                          entry.get("evidence") or "", tier, split))
    return tasks


def load_spider(root, split="train"):
    """Spider layout: train_spider.json / dev.json (with "query"), database/<db_id>/<db_id>.sqlite."""
    return _load(root, SPIDER_FILES, split, "query", "Spider")


def load_bird(root, split="dev"):
    """BIRD layout: dev.json / train.json (with "SQL", "evidence"), dev_databases/<db_id>/<db_id>.sqlite."""
    return _load(root, BIRD_FILES, split, "SQL", "BIRD")


def load_tasks(source=None, split="train", seed=0):
    """Tasks of one split: the embedded set (source None or "default"), or a Spider or BIRD folder."""
    if source in (None, "default"):
        if split not in SPLITS:
            raise ValueError(f"the embedded question set has splits {', '.join(SPLITS)}, not {split!r}")
        return list(_embedded_tasks(seed, default_db_path(seed))[split])
    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"no data folder at {root} (pass a Spider or BIRD folder, or None)")
    if (root / "database").is_dir():
        return load_spider(root, split)
    if (root / "dev_databases").is_dir() or (root / "train_databases").is_dir():
        return load_bird(root, split)
    raise ValueError(f"{root} is neither a Spider folder (with database/) nor a BIRD folder "
                     f"(with dev_databases/ or train_databases/)")


if __name__ == "__main__":
    start = time.time()
    splits = {split: load_tasks(split=split) for split in SPLITS}
    print(f"embedded database at {default_db_path()}, questions ready in {time.time() - start:.2f} s\n")
    env = SQLEnv(splits["train"][0])
    print(">>> list_tables()\n" + env.call("list_tables", {}) + "\n")
    print('>>> describe_table("orders")\n' + env.call("describe_table", {"table": "orders"}) + "\n")
    for tier in TIERS:
        for task in [t for t in splits["train"] if t.difficulty == tier][:2]:
            print(f"[{tier}] {task.question}\n  {task.gold_sql}\n  "
                  + env.call("run_sql", {"query": task.gold_sql}).replace("\n", "\n  ") + "\n")
    for split, tasks in splits.items():
        counts = ", ".join(f"{tier} {sum(t.difficulty == tier for t in tasks)}" for tier in TIERS)
        print(f"{split}: {len(tasks)} questions ({counts})")
