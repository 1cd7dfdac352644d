"""The embedded dataset: a generated retail database, rendered under several schemas, and its
question set in four tiers. Data, kept apart from the environment (`sql_env.py`) a reader studies.

    database_path(seed=0, rendering=0)   # one rendering's SQLite file, built on first use
    split_questions("test_schema")       # [(tier, question, gold_sql, rendering), ...];
                                         # sql_env.load_tasks wraps them

- The world: a retailer (stores, employees, categories, products, customers, orders,
  order_items; about 4,500 rows) generated from a seed, byte-identical for the same seed.
- Its renderings (`RENDERINGS`): the same rows under other table and column names (singular or
  plural, prefixes, snake_case or CamelCase, synonyms such as customers/clients, foreign keys
  named to match), each its own SQLite file in `files.cache_dir()`. Rendering 0 uses the original
  names; the last (`HELD_OUT_RENDERING`) is never trained on.
- The questions: templates with value slots and several wordings, in four tiers named after
  Spider's hardness levels (easy = one table; medium = an aggregate, a join or two conditions;
  hard = GROUP BY / ORDER BY / LIMIT / HAVING; extra = a nested query or two joins).

SQL templates name tables and columns with markers: `[customers]` is a table, `[customers.city]`
a column written bare, `[c.city]` a column under the alias the template declares with
`[customers] AS c`. `resolve` writes one rendering's names into a template before the value slots
(`{city}`) are filled, so every gold query exists for every rendering, never made by editing a
finished query. `SCHEMA` is written with the same markers.

The splits (`SPLITS`):
- train: every train question on one training rendering, in turn along the seeded shuffle;
- test: held out three ways, on rendering 0: every template's last wording, every fourth value of
  each value domain, and a few templates that combine skills seen separately in train;
- test_schema: the test questions on the held-out rendering, whose table names appear in no
  training rendering: what an agent that reads the schema can still answer;
- train_mixed: train's questions spread over the four training renderings and 28 generated ones
  (`MIXED_RENDERINGS`: each table's words from a training rendering, restyled, in 21 of the 28
  prefixed, as dw_clients or DwTblProduct), so that no one schema can be recalled;
- train_wide: the same over 28 other generated renderings (`WIDE_RENDERINGS`) in which three
  tables in four are renamed with a word no hand-written rendering uses (`TABLE_WORDS`), their
  columns unchanged: the table has to be found by its columns, as on the held-out schema.
Every gold query is run when the set is generated and kept only if its answer is non-empty,
short, and the same whichever way ties are broken (`is_clear`).

It imports nothing of the project's but `files`. The database is our own, so this module reads
it with plain sqlite3, not through the agent's sandbox.
"""
import functools
import itertools
import random
import re
import sqlite3
from contextlib import closing
from datetime import date
from pathlib import Path
from typing import NamedTuple

from files import atomic_path, cache_dir

SPLITS = ("train", "test", "test_schema", "train_mixed", "train_wide")

# The schema of the world, with markers for every name (a rendering writes its own names in).
SCHEMA = """
CREATE TABLE [stores] ([stores.store_id] INTEGER PRIMARY KEY, [stores.name] TEXT NOT NULL,
  [stores.city] TEXT NOT NULL, [stores.country] TEXT NOT NULL, [stores.opened_on] DATE NOT NULL);
CREATE TABLE [employees] ([employees.employee_id] INTEGER PRIMARY KEY, [employees.first_name] TEXT NOT NULL,
  [employees.last_name] TEXT NOT NULL, [employees.role] TEXT NOT NULL,
  [employees.store_id] INTEGER NOT NULL REFERENCES [stores]([stores.store_id]),
  [employees.salary] REAL NOT NULL, [employees.hired_on] DATE NOT NULL);
CREATE TABLE [categories] ([categories.category_id] INTEGER PRIMARY KEY, \
[categories.name] TEXT NOT NULL UNIQUE);
CREATE TABLE [products] ([products.product_id] INTEGER PRIMARY KEY, [products.name] TEXT NOT NULL UNIQUE,
  [products.category_id] INTEGER NOT NULL REFERENCES [categories]([categories.category_id]),
  [products.price] REAL NOT NULL, [products.stock] INTEGER NOT NULL, [products.discontinued_on] DATE);
CREATE TABLE [customers] ([customers.customer_id] INTEGER PRIMARY KEY, [customers.first_name] TEXT NOT NULL,
  [customers.last_name] TEXT NOT NULL, [customers.email] TEXT, [customers.city] TEXT NOT NULL,
  [customers.country] TEXT NOT NULL, [customers.joined_on] DATE NOT NULL);
CREATE TABLE [orders] ([orders.order_id] INTEGER PRIMARY KEY,
  [orders.customer_id] INTEGER NOT NULL REFERENCES [customers]([customers.customer_id]),
  [orders.store_id] INTEGER NOT NULL REFERENCES [stores]([stores.store_id]),
  [orders.employee_id] INTEGER REFERENCES [employees]([employees.employee_id]),
  [orders.order_date] DATE NOT NULL, [orders.status] TEXT NOT NULL);
CREATE TABLE [order_items] ([order_items.order_id] INTEGER NOT NULL REFERENCES [orders]([orders.order_id]),
  [order_items.product_id] INTEGER NOT NULL REFERENCES [products]([products.product_id]),
  [order_items.quantity] INTEGER NOT NULL, [order_items.unit_price] REAL NOT NULL,
  PRIMARY KEY ([order_items.order_id], [order_items.product_id]));
"""
# The logical tables and their columns, in the order of SCHEMA (and of the generated rows).
COLUMNS = {
    "stores": "store_id name city country opened_on",
    "employees": "employee_id first_name last_name role store_id salary hired_on",
    "categories": "category_id name",
    "products": "product_id name category_id price stock discontinued_on",
    "customers": "customer_id first_name last_name email city country joined_on",
    "orders": "order_id customer_id store_id employee_id order_date status",
    "order_items": "order_id product_id quantity unit_price",
}
# Each rendering names every logical table, then its columns in the order of COLUMNS. A foreign
# key is named like the key it references, in the referencing table's style (in the generated
# renderings below, each table keeps its own rendering's name for it: StoreId -> TblStore.StId).
RENDERINGS = [
    ("plain", {  # the original names: snake_case, plural
        "stores": "stores store_id name city country opened_on",
        "employees": "employees employee_id first_name last_name role store_id salary hired_on",
        "categories": "categories category_id name",
        "products": "products product_id name category_id price stock discontinued_on",
        "customers": "customers customer_id first_name last_name email city country joined_on",
        "orders": "orders order_id customer_id store_id employee_id order_date status",
        "order_items": "order_items order_id product_id quantity unit_price"}),
    ("camel", {  # CamelCase, singular (Order is an SQL keyword: CustomerOrder)
        "stores": "Store StoreId Name City Country OpenedOn",
        "employees": "Employee EmployeeId FirstName LastName Role StoreId Salary HiredOn",
        "categories": "Category CategoryId Name",
        "products": "Product ProductId Name CategoryId Price Stock DiscontinuedOn",
        "customers": "Customer CustomerId FirstName LastName Email City Country JoinedOn",
        "orders": "CustomerOrder OrderId CustomerId StoreId EmployeeId OrderDate Status",
        "order_items": "OrderLine OrderId ProductId Quantity UnitPrice"}),
    ("synonyms", {  # other words for the same things
        "stores": "shops shop_id shop_name town nation opening_date",
        "employees": "staff staff_id given_name family_name job_title shop_id pay start_date",
        "categories": "product_groups group_id group_name",
        "products": "items item_id item_name group_id list_price units_in_stock retired_on",
        "customers": "clients client_id given_name family_name email_address town nation signup_date",
        "orders": "purchases purchase_id client_id shop_id staff_id purchase_date state",
        "order_items": "purchase_lines purchase_id item_id qty price_paid"}),
    ("prefixed", {  # a legacy style: table prefix, singular, column prefixes
        "stores": "tbl_store st_id st_name st_city st_country st_opened",
        "employees": "tbl_employee emp_id emp_first_name emp_last_name emp_role st_id emp_salary emp_hired",
        "categories": "tbl_category cat_id cat_name",
        "products": "tbl_product prod_id prod_name cat_id prod_price prod_stock prod_discontinued",
        "customers": "tbl_customer cust_id cust_first_name cust_last_name cust_email cust_city cust_country "
                     "cust_joined",
        "orders": "tbl_order ord_id cust_id st_id emp_id ord_date ord_status",
        "order_items": "tbl_order_item ord_id prod_id oi_quantity oi_unit_price"}),
    ("unseen", {  # held out: table words no training rendering uses, CamelCase plural
        "stores": "Outlets OutletId OutletName Town Nation OpenDate",
        "employees": "Workers WorkerId GivenName FamilyName JobTitle OutletId Pay StartDate",
        "categories": "Departments DepartmentId DepartmentName",
        "products": "Articles ArticleId ArticleName DepartmentId ListPrice UnitsInStock RetiredOn",
        "customers": "Buyers BuyerId GivenName FamilyName EmailAddress Town Nation SignupDate",
        "orders": "Sales SaleId BuyerId OutletId WorkerId SaleDate State",
        "order_items": "SaleLines SaleId ArticleId Qty PricePaid"}),
]
HELD_OUT_RENDERING = len(RENDERINGS) - 1                 # never trained on: the test_schema split
TRAIN_RENDERINGS = tuple(range(HELD_OUT_RENDERING))
# "": no prefix, 1 draw in 5
NAME_PREFIXES = ("", "", "app", "biz", "core", "crm", "dw", "erp", "main", "src")


def restyle(name, style, prefix=""):
    """A name in snake_case or CamelCase, after an optional prefix: ("CustomerId", "snake") ->
    "customer_id", ("order_items", "camel", "crm") -> "CrmOrderItems"."""
    words = ([prefix] if prefix else []) + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower().split("_")
    return "_".join(words) if style == "snake" else "".join(w.capitalize() for w in words)


def restyle_table(entry, style, prefix=""):
    """One table of a rendering, "table column ...", restyled: every name in `style`, the table's
    name alone after the prefix."""
    first, *columns = entry.split()
    return " ".join([restyle(first, style, prefix)] + [restyle(c, style) for c in columns])


def _table_names(spec):
    """A rendering's table names as SQLite compares them (case ignored)."""
    return frozenset(entry.split()[0].lower() for entry in spec.values())


def _mixed_rendering(k, taken, kind="mixed"):
    """The k-th generated rendering: each table takes its names (table and columns, foreign keys
    included, so a join may pair OrdId with CustomerId) from a training rendering drawn for it, then
    every name is restyled (snake_case or CamelCase) and every table name gets one prefix (or
    none), both drawn for the rendering. The words stay the training renderings' (restyled, some
    are the held-out schema's column names: GivenName, Town), but their combination is new, so an
    agent has to read the table list, not recall one schema. Redrawn until its table names differ
    from every rendering in `taken` (SQLite ignores case); one table alone may still match a
    hand-written one. kind "wide" then renames three tables in four with a word of TABLE_WORDS
    (its columns keep their names: patrons(customer_id, first_name, ...)), so that the table a
    question means is found by its columns, not by the question's noun."""
    rng = random.Random(f"{kind}/{k}")
    while True:
        style, prefix = rng.choice(("snake", "camel")), rng.choice(NAME_PREFIXES)
        spec = {table: restyle_table(RENDERINGS[rng.choice(TRAIN_RENDERINGS)][1][table], style, prefix)
                for table in COLUMNS}
        if kind == "wide":
            for table, entry in spec.items():
                if rng.random() < 0.75:
                    spec[table] = " ".join([restyle(rng.choice(TABLE_WORDS[table].split()), style, prefix)]
                                           + entry.split()[1:])
        if _table_names(spec) not in taken:
            return f"{kind}{k:02d}", spec


def _mixed_renderings(count, kind="mixed"):
    taken, out = {_table_names(spec) for _, spec in RENDERINGS}, []
    for k in range(count):
        out.append(_mixed_rendering(k, taken, kind))
        taken.add(_table_names(out[-1][1]))
    return out


# Other words for each table, for the train_wide split's renderings; none is a table word of any
# hand-written rendering (the held-out one's least of all), nor an SQL keyword.
TABLE_WORDS = {
    "stores": "branches locations sites venues boutiques",
    "employees": "personnel associates clerks team_members agents",
    "categories": "sections families classes kinds genres",
    "products": "goods merchandise skus wares catalog_entries",
    "customers": "patrons shoppers members accounts consumers",
    "orders": "transactions invoices bookings baskets receipts",
    "order_items": "invoice_lines line_items basket_items receipt_lines positions",
}
MIXED_RENDERINGS = tuple(range(len(RENDERINGS), len(RENDERINGS) + 28))   # the train_mixed split's own
RENDERINGS += _mixed_renderings(len(MIXED_RENDERINGS))
WIDE_RENDERINGS = tuple(range(len(RENDERINGS), len(RENDERINGS) + 28))    # the train_wide split's own
RENDERINGS += _mixed_renderings(len(WIDE_RENDERINGS), kind="wide")
# per training split
GENERATED_RENDERINGS = {"train": (), "train_mixed": MIXED_RENDERINGS, "train_wide": WIDE_RENDERINGS}
_MARKER = re.compile(r"\[(\w+)(?:\.(\w+))?\]")            # [table], [table.column] or [alias.column]


def names(rendering):
    """{logical table: physical name} and {(logical table, logical column): physical name}."""
    tables, columns = {}, {}
    for table, spec in RENDERINGS[rendering][1].items():
        physical = spec.split()
        assert len(physical) == 1 + len(COLUMNS[table].split()), (f"rendering {rendering}: {table} "
                                                                  f"needs every column")
        tables[table] = physical[0]
        columns.update({(table, c): p for c, p in zip(COLUMNS[table].split(), physical[1:])})
    return tables, columns


def resolve(template, rendering):
    """A template (SQL or SCHEMA) with its name markers written in one rendering's names; the value
    slots ({city}) are left for str.format. An alias is declared once per template, `[table] AS x`."""
    tables, columns = names(rendering)
    declared = re.findall(r"\[(\w+)\] AS (\w+)", template)
    aliases = dict((alias, table) for table, alias in declared)
    assert len(aliases) == len(declared), f"an alias is declared twice in {template!r}"

    def name(match):
        first, column = match.groups()
        if column is None:
            return tables[first]
        if first in tables:
            return columns[first, column]
        assert first in aliases, f"[{first}.{column}]: no table or declared alias {first!r} in {template!r}"
        return f"{first}.{columns[aliases[first], column]}"
    return _MARKER.sub(name, template)


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


def build_database(path, seed=0, rendering=0):
    """Write the world under one rendering to `path` atomically (files.atomic_path); same seed and
    rendering, same bytes. Every rendering holds the same rows."""
    tables, _ = names(rendering)
    with atomic_path(path) as tmp:
        with closing(sqlite3.connect(tmp)) as con:
            con.executescript(resolve(SCHEMA, rendering))
            for table, rows in _retail_rows(seed).items():
                con.executemany(f"INSERT INTO {tables[table]} VALUES ({', '.join('?' * len(rows[0]))})", rows)
            con.commit()
    return path


def _open_read_only(path):
    return sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)


def database_path(seed=0, rendering=0):
    """One rendering's database path; built on first use, and rebuilt if missing or corrupt."""
    path = str(cache_dir() / f"retail-v2-seed{seed}-{RENDERINGS[rendering][0]}.sqlite")
    try:
        with closing(_open_read_only(path)) as con:
            intact = (con.execute("PRAGMA quick_check").fetchone() == ("ok",) and
                      con.execute("SELECT COUNT(*) FROM sqlite_master "
                                  "WHERE type = 'table'").fetchone() == (7,))
    except sqlite3.Error:
        intact = False
    return path if intact else build_database(path, seed, rendering)


# Question templates: (tier, value domains, gold SQL, wordings separated by " | "). The LAST wording of
# each is kept for the test split. Tiers follow Spider: easy = one table; medium = an aggregate, a join or
# two conditions; hard = GROUP BY / ORDER BY / LIMIT / HAVING; extra = a nested query or two joins.
# Names are markers (`resolve`): [table], [table.column] written bare, [alias.column] after
# `[table] AS alias`.
_CAT = "FROM [products] AS p JOIN [categories] AS c ON [p.category_id] = [c.category_id]"
_ITEMS = "FROM [orders] AS o JOIN [order_items] AS i ON [o.order_id] = [i.order_id]"
_WHO = "WHERE [c.first_name] = '{first}' AND [c.last_name] = '{last}'"
_REVENUE = "SUM([i.quantity] * [i.unit_price])"
TEMPLATES = [
    ("easy", "city", "SELECT COUNT(*) FROM [customers] WHERE [customers.city] = '{city}'",
     "How many customers live in {city}? | Count the customers based in {city}. | What is the number of "
     "customers whose city is {city}?"),
    ("easy", "product", "SELECT [products.price] FROM [products] WHERE [products.name] = '{product}'",
     "What is the price of the {product}? | How much does the {product} cost? | "
     "Give the price of the {product}."),
    ("easy", "product", "SELECT [products.stock] FROM [products] WHERE [products.name] = '{product}'",
     "How many units of the {product} are in stock? | What is the stock level of the {product}? | "
     "How many {product} units do we have in stock?"),
    ("easy", "price", "SELECT COUNT(*) FROM [products] WHERE [products.price] > {price}",
     "How many products cost more than ${price}? | Count the products priced above {price} dollars. | "
     "What is the number of products with a price over ${price}?"),
    ("easy", "year", "SELECT COUNT(*) FROM [customers] "
     "WHERE strftime('%Y', [customers.joined_on]) = '{year}'",
     "How many customers joined in {year}? | Count the customers who signed up in {year}. | "
     "How many new customers did we get in {year}?"),
    ("easy", "month", "SELECT COUNT(*) FROM [orders] "
     "WHERE strftime('%Y-%m', [orders.order_date]) = '{month}'",
     "How many orders were placed in {month_name}? | Count the orders made in {month_name}. | "
     "What is the number of orders from {month_name}?"),
    ("easy", "customer", "SELECT [customers.email] FROM [customers] AS c " + _WHO,
     "What is the email address of {first} {last}? | Give the email of the customer {first} {last}. | "
     "Which email address does customer {first} {last} use?"),
    ("easy", "customer", "SELECT [customers.city] FROM [customers] AS c " + _WHO,
     "Which city does {first} {last} live in? | In what city is the customer {first} {last} based? | "
     "Where does customer {first} {last} live?"),
    ("medium", "category", f"SELECT AVG([p.price]) {_CAT} WHERE [c.name] = '{{category}}'",
     "What is the average price of products in the {category} category? | What do {category} products cost "
     "on average? | Give the mean price of the {category} products."),
    ("medium", "category", f"SELECT COUNT(*) {_CAT} WHERE [c.name] = '{{category}}'",
     "How many products are in the {category} category? | Count the {category} products. | "
     "What is the number of products in category {category}?"),
    ("medium", "category price", f"SELECT [p.name] {_CAT} WHERE [c.name] = '{{category}}' "
     f"AND [p.price] < {{price}}",
     "Which {category} products cost less than ${price}? | List the {category} products priced under {price} "
     "dollars. | Name the products in the {category} category that are cheaper than ${price}."),
    ("medium", "role", "SELECT MAX([employees.salary]) FROM [employees] WHERE [employees.role] = '{role}'",
     "What is the highest salary of any {role}? | How much does the best-paid {role} earn? | "
     "Give the maximum salary among employees with the role {role}."),
    ("medium", "country", "SELECT AVG([e.salary]) FROM [employees] AS e JOIN [stores] AS s ON [e.store_id] = "
     "[s.store_id] WHERE [s.country] = '{country}'",
     "What is the average salary of employees working in {country}? | How much do our employees in {country} "
     "earn on average? | Give the mean salary of staff at stores in {country}."),
    ("medium", "city", "SELECT COUNT(*) FROM [customers] WHERE [customers.city] = '{city}' "
     "AND [customers.email] IS NULL",
     "How many customers in {city} have no email address? | Count the customers from {city} without an "
     "email. | How many {city} customers are missing an email address?"),
    ("medium", "city year", "SELECT COUNT(*) FROM [customers] WHERE [customers.city] = '{city}' "
     "AND strftime('%Y', [customers.joined_on]) = '{year}'",
     "How many customers from {city} joined in {year}? | Count the customers in {city} who signed up in "
     "{year}. | In {year}, how many new customers came from {city}?"),
    ("medium", "status month", "SELECT COUNT(*) FROM [orders] WHERE [orders.status] = '{status}' "
     "AND strftime('%Y-%m', [orders.order_date]) = '{month}'",
     "How many orders from {month_name} have the status {status}? | Count the {status} orders placed in "
     "{month_name}. | Of the orders made in {month_name}, how many are {status}?"),
    ("medium", "city", "SELECT COUNT(*) FROM [orders] AS o JOIN [stores] AS s ON [o.store_id] = [s.store_id] "
     "WHERE [s.city] = '{city}'",
     "How many orders were placed at the store in {city}? | Count the orders of our {city} store. | "
     "What is the number of orders handled by the {city} store?"),
    ("medium", "city", "SELECT [e.first_name], [e.last_name] FROM [employees] AS e JOIN [stores] AS s "
     "ON [e.store_id] = [s.store_id] WHERE [s.city] = '{city}'",
     "Who works at the store in {city}? Give first and last names. | List the names of the employees of the "
     "{city} store. | Give the first and last name of every employee at our {city} store."),
    ("medium", "product", "SELECT COUNT(*) FROM [order_items] AS i JOIN [products] AS p ON [i.product_id] = "
     "[p.product_id] WHERE [p.name] = '{product}'",
     "How many orders include the {product}? | In how many orders was the {product} bought? | "
     "Count the orders containing the {product}."),
    ("hard", "category", f"SELECT [p.name] {_CAT} WHERE [c.name] = '{{category}}' "
     "ORDER BY [p.price] DESC LIMIT 1",
     "What is the most expensive product in the {category} category? | Which {category} product has the "
     "highest price? | Name the priciest {category} product."),
    ("hard", "category", f"SELECT [p.name] {_CAT} WHERE [c.name] = '{{category}}' ORDER BY [p.price] LIMIT 3",
     "List the three cheapest {category} products, cheapest first. | What are the 3 lowest-priced {category} "
     "products, from the cheapest? | Give the three least expensive {category} products in order of price."),
    ("hard", "month", "SELECT [orders.status], COUNT(*) FROM [orders] "
     "WHERE strftime('%Y-%m', [orders.order_date]) = '{month}' GROUP BY [orders.status]",
     "For each status, how many orders were placed in {month_name}? | Count the orders of {month_name} per "
     "status. | Give every order status with its number of orders in {month_name}."),
    ("hard", "price", f"SELECT [c.name], COUNT(*) {_CAT} WHERE [p.price] > {{price}} GROUP BY [c.name]",
     "For each category, how many products cost more than ${price}? | Count the products priced above "
     "{price} dollars in every category. | "
     "Per category, give the number of products with a price over ${price}."),
    ("hard", "price", f"SELECT [c.name] {_CAT} GROUP BY [c.name] HAVING AVG([p.price]) > {{price}}",
     "Which categories have an average product price above ${price}? | List the categories whose products "
     "cost more than {price} dollars on average. | "
     "Name the categories with a mean price greater than ${price}."),
    ("hard", "salary", "SELECT [employees.role], COUNT(*) FROM [employees] "
     "WHERE [employees.salary] > {salary} GROUP BY [employees.role]",
     "For each role, how many employees earn more than {salary}? | Count the employees with a salary above "
     "{salary} per role. | Per role, give the number of staff members paid over {salary}."),
    ("hard", "city", "SELECT [e.first_name], [e.last_name] FROM [employees] AS e JOIN [stores] AS s "
     "ON [e.store_id] = [s.store_id] WHERE [s.city] = '{city}' ORDER BY [e.salary] DESC LIMIT 1",
     "Who is the best-paid employee at the {city} store? | Which employee of the {city} store has the "
     "highest salary? | Name the employee with the top salary at our store in {city}."),
    ("hard", "country", "SELECT [customers.city] FROM [customers] WHERE [customers.country] = '{country}' "
     "GROUP BY [customers.city] ORDER BY COUNT(*) DESC LIMIT 1",
     "Which city in {country} has the most customers? | In {country}, which city do most of our customers "
     "live in? | Name the city of {country} with the largest number of customers."),
    ("hard", "customer", "SELECT [o.order_date] FROM [orders] AS o JOIN [customers] AS c "
     f"ON [o.customer_id] = [c.customer_id] {_WHO} ORDER BY [o.order_date] DESC LIMIT 1",
     "When did {first} {last} place their most recent order? | What is the date of the latest order by "
     "{first} {last}? | On which day did customer {first} {last} last order?"),
    ("extra", "category", f"SELECT [p.name] {_CAT} WHERE [c.name] = '{{category}}' AND [p.price] > "
     "(SELECT AVG([products.price]) FROM [products])",
     "Which {category} products cost more than the average product? | List the {category} products priced "
     "above the average price of all products. | "
     "Name the {category} products dearer than the overall average."),
    ("extra", "city", "SELECT [customers.first_name], [customers.last_name] FROM [customers] "
     "WHERE [customers.city] = '{city}' AND [customers.customer_id] NOT IN "
     "(SELECT [orders.customer_id] FROM [orders])",
     "Which customers in {city} have never placed an order? | List the customers from {city} without any "
     "orders. | Give the names of {city} customers who have not ordered anything."),
    ("extra", "city year", f"SELECT {_REVENUE} {_ITEMS} JOIN [stores] AS s ON [o.store_id] = [s.store_id] "
     "WHERE [s.city] = '{city}' AND strftime('%Y', [o.order_date]) = '{year}'",
     "What was the total revenue of the {city} store in {year}? | How much did the {city} store sell in "
     "{year}, in money? | Give the {year} sales revenue of our store in {city}."),
    ("extra", "category", f"SELECT [p.name] {_CAT} JOIN [order_items] AS i "
     "ON [i.product_id] = [p.product_id] "
     "WHERE [c.name] = '{category}' GROUP BY [p.product_id] ORDER BY SUM([i.quantity]) DESC LIMIT 1",
     "Which {category} product has sold the most units? | What is the best-selling {category} product by "
     "quantity? | Name the {category} product with the largest number of units sold."),
    ("extra", "category year", f"SELECT COUNT(DISTINCT [o.customer_id]) {_ITEMS} JOIN [products] AS p ON "
     "[i.product_id] = [p.product_id] JOIN [categories] AS c ON [p.category_id] = [c.category_id] "
     "WHERE [c.name] = '{category}' AND strftime('%Y', [o.order_date]) = '{year}'",
     "How many different customers bought {category} products in {year}? | Count the distinct customers who "
     "ordered {category} items in {year}. | "
     "In {year}, how many customers bought from the {category} category?"),
    ("extra", "city", f"SELECT [c.first_name], [c.last_name] {_ITEMS} JOIN [customers] AS c "
     f"ON [o.customer_id] = [c.customer_id] WHERE [c.city] = '{{city}}' "
     f"GROUP BY [c.customer_id] ORDER BY {_REVENUE} DESC LIMIT 1",
     "Which customer from {city} has spent the most money? | Who is the biggest spender among our {city} "
     "customers? | Name the {city} customer with the highest total spending."),
    ("extra", "customer", f"SELECT {_REVENUE} {_ITEMS} JOIN [customers] AS c "
     "ON [o.customer_id] = [c.customer_id] " + _WHO,
     "How much has {first} {last} spent in total? | What is the total amount of all orders by {first} "
     "{last}? | Give the total spending of customer {first} {last}."),
    ("extra", "product", f"SELECT COUNT(DISTINCT [o.customer_id]) {_ITEMS} JOIN [products] AS p "
     "ON [i.product_id] = [p.product_id] WHERE [p.name] = '{product}'",
     "How many different customers have bought the {product}? | Count the distinct customers who ordered "
     "the {product}. | By how many customers was the {product} purchased?"),
]
# Whole templates used only in test: new combinations of skills that train teaches separately.
HELD_OUT_TEMPLATES = [
    ("easy", "city", "SELECT [customers.first_name], [customers.last_name] FROM [customers] "
     "WHERE [customers.city] = '{city}' AND [customers.email] IS NULL",
     "Which customers in {city} have no email address? Give their names."),
    ("medium", "city month", "SELECT COUNT(*) FROM [orders] AS o JOIN [stores] AS s ON [o.store_id] = "
     "[s.store_id] WHERE [s.city] = '{city}' AND strftime('%Y-%m', [o.order_date]) = '{month}'",
     "How many orders did the {city} store receive in {month_name}?"),
    ("hard", "category price", f"SELECT [p.name] {_CAT} WHERE [c.name] = '{{category}}' "
     f"AND [p.price] < {{price}} ORDER BY [p.price] DESC LIMIT 1",
     "What is the most expensive {category} product that costs less than ${price}?"),
    ("extra", "product year", f"SELECT {_REVENUE} {_ITEMS} JOIN [products] AS p ON [i.product_id] = "
     "[p.product_id] WHERE [p.name] = '{product}' AND strftime('%Y', [o.order_date]) = '{year}'",
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


def is_clear(con, sql):
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


class Question(NamedTuple):
    tier: str
    text: str
    golds: tuple    # the gold SQL under each rendering: golds[r] runs on database_path(seed, r)


@functools.lru_cache(maxsize=4)
def questions(seed=0):
    """{"train" | "test": [Question]}: each template filled with its split's values and wordings,
    its gold SQL made for every rendering, validated on rendering 0's database (is_clear; the
    rows are the same in every rendering), in a shuffled order fixed by the seed."""
    domains, out = _domains(seed), {}
    with closing(_open_read_only(database_path(seed))) as con:
        for split in ("train", "test"):
            templates = TEMPLATES + (HELD_OUT_TEMPLATES if split == "test" else [])
            kept_questions = []
            for k, (tier, slots, sql, wordings) in enumerate(templates):
                rng, wordings = random.Random(f"{seed}/{split}/{k}"), wordings.split(" | ")
                if k < len(TEMPLATES):  # a shared template: train gets all wordings but the last
                    wordings = wordings[:-1] if split == "train" else wordings[-1:]
                rendered = [resolve(sql, r) for r in range(len(RENDERINGS))]   # names first, values next
                combos = list(itertools.product(*(domains[d][split] for d in slots.split())))
                rng.shuffle(combos)
                kept = 0
                for combo in combos:
                    values = {key: v for part in combo for key, v in part.items()}
                    golds = tuple(sql.format(**values) for sql in rendered)
                    if is_clear(con, golds[0]):
                        kept_questions.append(Question(tier, rng.choice(wordings).format(**values), golds))
                        kept += 1
                        if kept == PER_TEMPLATE[split]:
                            break
            random.Random(f"{seed}/{split}").shuffle(kept_questions)
            out[split] = kept_questions
    return out


def split_questions(split, seed=0):
    """[(tier, question, gold_sql, rendering)] of one of SPLITS: train spreads its questions over
    the training renderings (the i-th question of the seeded shuffle on rendering i mod 4), and
    train_mixed and train_wide over those and their own generated ones (i mod 32); test is on
    rendering 0; test_schema is test on the held-out rendering."""
    assert split in SPLITS, f"the embedded question set has splits {', '.join(SPLITS)}, not {split!r}"
    if split in GENERATED_RENDERINGS:
        spread = TRAIN_RENDERINGS + GENERATED_RENDERINGS[split]
        chosen = [(q, spread[i % len(spread)]) for i, q in enumerate(questions(seed)["train"])]
    else:
        rendering = 0 if split == "test" else HELD_OUT_RENDERING
        chosen = [(q, rendering) for q in questions(seed)["test"]]
    return [(q.tier, q.text, q.golds[r], r) for q, r in chosen]
