-- GROUP BY six keys: about one group per row (nothing shrinks).
SELECT count(*) AS groups, sum(n) AS rows, sum(total) AS total
FROM (
  SELECT k10, k1k, k100k, s10, n1k, q, count(*) AS n, sum(q * 2) AS total
  FROM facts
  GROUP BY k10, k1k, k100k, s10, n1k, q
) g
